"""Output processing, the reader's half: the engine's EngineCoreOutputs (token ids, their
log-probabilities as numbers, the stops the engine sees: core_output_processor.py) into
RequestOutputs: each completion's incremental text (detokenizer.py) and its stop strings, the
log-probabilities with their tokens' text, and the n completions of one user request as one
output, in its output kind (DELTA: what each step added; CUMULATIVE; FINAL_ONLY). It runs where
the outputs are read, LLMEngine.step or a server's HTTP process (entrypoints/openai/
async_engine.py), so that the engine's process does none of this work, as vLLM splits it. A stop
string ends a completion here: process returns it, for the engine to stop computing it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from picovllm.engine.detokenizer import Detokenizer
from picovllm.kv_transfer_params import KVTransferParams
from picovllm.messages import CompletionDelta, EngineCoreOutput
from picovllm.outputs import CompletionOutput, Logprob, RequestOutput
from picovllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("picovllm")


@dataclass(eq=False)
class RequestState:
    """One completion as its reader has it: its tokens, text (and the detokenizer's state for it),
    logprobs, and why it finished."""

    index: int  # which of the request's n completions
    params: SamplingParams
    token_ids: list[int]  # prompt followed by the generated tokens
    num_prompt_tokens: int
    # detokenizer state (see detokenizer.py)
    output_text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    decode_stream: object = None  # a tokenizers DecodeStream, and the tokens it has seen
    num_streamed: int = 0
    stream_holds_prompt: bool = False  # its stream holds the prompt's last bytes (an incomplete character)
    text_at_end: bool = False  # decoded once, when it ends (nothing reads its text before)
    num_output_sent: int = 0  # RequestOutputKind.DELTA: output tokens (and logprobs) reported so far
    text_sent: int = 0  # and characters of output_text
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass(eq=False)
class RequestGroup:
    """The n completions of one user request."""

    prompt: str | None
    prompt_token_ids: list[int]
    children: list[RequestState]
    arrival_time: float  # time.time(), as vLLM's RequestMetrics
    first_token_time: float | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: KVTransferParams | None = None  # a prefill instance's answer: where the KV is held
    prompt_logprobs: list | None = None  # (once whole)
    prompt_logprobs_sent: bool = False  # (a DELTA stream's, sent with its first output)
    kind: RequestOutputKind = RequestOutputKind.CUMULATIVE


class OutputProcessor:
    """The requests being read, by user request (their groups), until their last output. A
    server's adds and aborts may come from another thread than the one that processes (AsyncEngine):
    a group is looked up once per output."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.groups: dict[str, RequestGroup] = {}
        self.failed: list[tuple[str, str]] = []  # (request id, why): outputs that could not be read

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams) -> None:
        n_prompt, logprobs = len(prompt_token_ids), params.logprobs is not None
        children = [
            RequestState(i, params, list(prompt_token_ids), n_prompt, logprobs=[] if logprobs else None)
            for i in range(params.n)
        ]
        if self.detokenizer is not None:
            for st in children:
                self.detokenizer.start(st)
        self.groups[request_id] = RequestGroup(prompt, prompt_token_ids, children, time.time(), kind=params.output_kind)

    def abort(self, request_id: str) -> None:
        """Forget a request (aborted, or failed): its outputs from now on are dropped."""
        self.groups.pop(request_id, None)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """A step's EngineCoreOutputs into RequestOutputs (those of requests still read), and the
        completions a stop string has ended, as (request id, index): the engine is to finish them
        (it may have computed a few tokens more by then, which are dropped here). A request whose
        output raises here (its text, say) fails alone: take_failed reports it, for the caller to
        abort it in the engine; the others are read."""
        results, stopped = [], []
        now = time.time()
        for out in outputs:
            group = self.groups.get(out.request_id)
            if group is None:  # aborted meanwhile
                continue
            try:
                result = self._read(out, group, stopped, now)
            except Exception as e:
                logger.exception("request %s: its output could not be read: it fails", out.request_id)
                self.groups.pop(out.request_id, None)
                self.failed.append((out.request_id, f"its output could not be read: {type(e).__name__}: {e}"))
                continue
            if result is not None:
                results.append(result)
        return results, stopped

    def take_failed(self) -> list[tuple[str, str]]:
        """(request id, why) of the requests failed since the last call (see process)."""
        failed, self.failed = self.failed, []
        return failed

    def _read(
        self, out: EngineCoreOutput, group: RequestGroup, stopped: list[tuple[str, int]], now: float
    ) -> RequestOutput | None:
        """One request's output: its completions' new tokens taken (a stop string's end added to
        stopped); its RequestOutput, if its output kind has one now."""
        group.num_cached_tokens = out.num_cached_tokens
        if out.kv_transfer_params is not None:
            group.kv_transfer_params = out.kv_transfer_params
        if out.prompt_logprobs is not None:
            group.prompt_logprobs = [None] + [
                self._logprob_dict(row, token)
                for row, token in zip(out.prompt_logprobs[1:], group.prompt_token_ids[1:])
            ]
        changed = False
        for c in out.completions:
            st = group.children[c.index]
            if st.is_finished:  # (a stop string ended it: what the engine computed since is dropped)
                continue
            changed = True
            if self._append(st, c):
                stopped.append((out.request_id, c.index))
        if not changed:
            return None
        group.first_token_time = group.first_token_time or now
        if group.kind is not RequestOutputKind.FINAL_ONLY or all(st.is_finished for st in group.children):
            return self._output(out.request_id, group)
        return None

    def _append(self, st: RequestState, c: CompletionDelta) -> bool:
        """Take a completion's new tokens; True if a stop string ends it here (the engine had not)."""
        st.token_ids += c.token_ids
        if st.logprobs is not None:
            for token, row in zip(c.token_ids, c.logprobs):
                st.logprobs.append(self._logprob_dict(row, token))
                st.cumulative_logprob += st.logprobs[-1][token].logprob
        reason, stop_reason = c.finish_reason, c.stop_reason
        ends_here = False
        if self.detokenizer is not None and st.params.detokenize:
            if reason is None or reason == "length":
                stop = self.detokenizer.step(st)
                if stop is None and reason == "length":
                    stop = self.detokenizer.flush(st)
                if stop is not None:
                    ends_here = reason is None
                    reason, stop_reason = "stop", stop
            else:  # (ended at its last token: EOS, a stop token, its grammar; not part of its text)
                self.detokenizer.stopped(st)
        st.finish_reason, st.stop_reason = reason, stop_reason
        return ends_here

    def _logprob_dict(self, row: tuple, token: int) -> dict[int, Logprob]:
        """A logprobs row (logprob, rank, the request's top k ids and logprobs: core_output_processor.py's
        logprob_row) of `token`."""
        chosen, rank, top_ids, top_logprobs = row
        top = enumerate(zip(top_ids, top_logprobs), start=1)
        entries = {tid: Logprob(lp, r, self._decode_token(tid)) for r, (tid, lp) in top}
        entries[token] = Logprob(chosen, rank, self._decode_token(token))
        return entries

    def _decode_token(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def _output(self, request_id: str, group: RequestGroup) -> RequestOutput:
        finished = all(r.is_finished for r in group.children)
        delta = group.kind is RequestOutputKind.DELTA
        outputs = []
        for r in group.children:
            tokens, text, logprobs = self._take_delta(r) if delta else (r.output_token_ids, r.output_text, r.logprobs)
            outputs.append(
                CompletionOutput(
                    index=r.index,
                    text=text,
                    token_ids=tokens,
                    cumulative_logprob=r.cumulative_logprob if r.logprobs is not None else None,
                    logprobs=logprobs,
                    finish_reason=r.finish_reason,
                    stop_reason=r.stop_reason,
                )
            )
        if finished:
            self.groups.pop(request_id, None)  # (an abort may have taken it: AsyncEngine's thread)
        prompt_logprobs = None  # (once whole; a DELTA stream has them in one output)
        if group.prompt_logprobs is not None and not group.prompt_logprobs_sent:
            prompt_logprobs, group.prompt_logprobs_sent = group.prompt_logprobs, delta
        metrics = {"arrival_time": group.arrival_time}
        if group.first_token_time is not None:
            metrics["first_token_time"] = group.first_token_time
        if finished:
            metrics["finished_time"] = time.time()
        return RequestOutput(
            request_id,
            group.prompt,
            group.prompt_token_ids,
            outputs,
            finished,
            group.num_cached_tokens,
            metrics,
            group.kv_transfer_params if finished else None,
            prompt_logprobs,
        )

    @staticmethod
    def _take_delta(r: RequestState) -> tuple[list[int], str, list | None]:
        """The tokens, text and logprobs r generated since its last output (RequestOutputKind.DELTA),
        marked as sent. Only final text is sent (Detokenizer.final_text_len)."""
        tokens = r.token_ids[r.num_prompt_tokens + r.num_output_sent :]
        logprobs = None if r.logprobs is None else r.logprobs[r.num_output_sent :]
        r.num_output_sent += len(tokens)
        end = max(r.text_sent, Detokenizer.final_text_len(r))
        text, r.text_sent = r.output_text[r.text_sent : end], end
        return tokens, text, logprobs
