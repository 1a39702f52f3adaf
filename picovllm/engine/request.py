"""One sequence being generated. n > 1 completions of one prompt are n Requests sharing a parent."""

from __future__ import annotations

import enum

from picovllm.kv_transfer_params import KVTransferParams
from picovllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()  # queued, or preempted and waiting to be recomputed
    SWAPPED = enum.auto()  # preempted, its KV in host blocks (preemption_mode "swap"), queued to resume
    RUNNING = enum.auto()  # holds blocks; its KV covers its first num_computed_tokens tokens
    WAITING_FOR_REMOTE_KV = enum.auto()  # holds blocks for its prompt, being pulled from a prefill instance
    WAITING_FOR_GRAMMAR = enum.auto()  # its structured outputs' grammar compiling (not in the scheduler yet)
    FINISHED = enum.auto()


class Request:
    def __init__(
        self,
        request_id: str,
        parent_id: str,
        index: int,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: int,
        seed: int | None,
        max_model_len: int | None = None,
        kv_transfer_params: KVTransferParams | None = None,
    ):
        self.request_id = request_id
        self.parent_id = parent_id
        self.index = index  # which of the parent's n completions
        self.prompt = prompt
        self.token_ids = list(prompt_token_ids)  # prompt followed by the generated tokens
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        # the length at which it stops for length: max_tokens generated, or max_model_len reached
        limits = [
            n
            for n in (max_model_len, None if params.max_tokens is None else self.num_prompt_tokens + params.max_tokens)
            if n is not None
        ]
        self.max_num_tokens = min(limits, default=None)
        self.arrival = arrival
        self.seed = seed  # of its own generator (on the rank that samples); None: the global one
        self.status = RequestStatus.WAITING
        self.block_table: list[int] = []  # appended to, or replaced by another list: never changed in place
        self.num_cached_tokens = 0  # leading tokens whose KV came from the prefix cache this admission
        self.num_host_cached_tokens = 0  # of those, the ones the cache had on the host only
        self.host_blocks: list[int] = []  # SWAPPED: its KV, covering its first num_swapped_tokens tokens
        self.num_swapped_tokens = 0
        self.num_computed_tokens = 0  # leading tokens whose KV is in the cache (cached or computed)
        self.num_prompt_cached_tokens: int | None = None  # the same at its first admission (reported)
        self.lock_node = None  # the radix-tree node this request holds locked (prefix_cache.py)
        self.num_preemptions = 0
        # disaggregated prefill (engine/kv_handoff.py): on a prefill instance do_remote_decode; on
        # a decode instance where to pull the prompt's KV from (cleared once pulled)
        self.kv_transfer_params = kv_transfer_params
        self.grammar = None  # its structured outputs' xgrammar matcher (engine/structured_output.py)
        self.after: Request | None = None  # admitted once this sibling is past its pull (n > 1)
        self.num_output_sent = 0  # output tokens (and logprobs) in an EngineCoreOutput so far
        # per output token: (logprob, rank, top ids, top logprobs) (SamplingParams.logprobs)
        self.logprobs: list[tuple] | None = [] if params.logprobs is not None else None
        # its prompt's (the first completion's alone), as logprobs' rows: position p's, of prompt
        # token p given the ones before; None at 0 (SamplingParams.prompt_logprobs)
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None and index == 0 else None
        self.prompt_logprobs_sent = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether its prompt's log-probabilities are still to be computed (its prompt is then
        computed whole: no prefix-cache hit)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens})"
