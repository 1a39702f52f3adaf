"""Everything that crosses a process boundary, as types: between the server and the engine's
process (entrypoints/openai/async_engine.py), and between the engine and the tensor-parallel
ranks (executor/, worker/). Each message is dispatched by its type; its fields are its
documentation.

    server -> engine          AddRequest, AbortRequest, FinishRequest (a stop string), StopEngine
    engine -> server          EngineReady; EngineCoreOutputs (a step's outputs, the engine's
                              metrics); RequestsFailed (a step that raised); EngineDead
    engine -> every rank      ExecuteStep (StepInputs), AllocateKVCache, CaptureGraphs,
                              DescribeKV, PullKV, PollKV, Shutdown; StartRank (torchrun's)
    rank 0 -> engine          ModelRunnerOutput (its SamplerOutput, on the way to the host)
    rank r > 0 -> rank 0      WorkerJoining, WorkerReady, WorkerFailed; the answer of a command
                              that answers (DescribeKV, PollKV)

Rank 0 samples: a SamplingBatch goes to it alone, beside the ExecuteStep every rank runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import msgspec
import numpy as np
import torch

from picovllm.kv_transfer_params import KVTransferParams
from picovllm.sampling_params import SamplingParams

# ---- the server and the engine's process -------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    """A prompt that went through process_prompt (and its kv_transfer_params through their checks)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer_params: KVTransferParams | None = None


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class FinishRequest:
    """Completions that the server has finished (a stop string in their text: OutputProcessor),
    by (request id, index): the engine stops computing them."""

    completions: list[tuple[str, int]]


@dataclass(frozen=True)
class StopEngine:
    pass


EngineCommand = AddRequest | AbortRequest | FinishRequest | StopEngine


@dataclass(frozen=True)
class EngineReady:
    """What the server needs of the engine it started (its tokenizer: a directory to load it from)."""

    vocab_size: int
    max_model_len: int
    tokenizer: str | None
    kv_role: str
    block_size: int
    kv_lease_s: float
    kv_compat: dict
    metrics: dict  # (LLMEngine.get_metrics' at the start: the KV pool's size, ...)
    sampling_defaults: dict  # (the model's generation config's: LLMEngine.sampling_defaults)


# A log-probability row: the token's logprob, its rank, the top ids and their logprobs.
LogprobRow = tuple[float, int, list[int], list[float]]


class CompletionDelta(msgspec.Struct, array_like=True, gc=False):
    """What the engine added to one completion (of a request's n) since its last output: token
    ids, their log-probabilities as numbers, and why it finished, if it did (EOS, a stop token,
    max_tokens, its grammar; a stop string is found where the text is: OutputProcessor)."""

    index: int
    token_ids: list[int]
    logprobs: list[LogprobRow] | None  # one row per token
    finish_reason: str | None
    stop_reason: int | None


class EngineCoreOutput(msgspec.Struct, array_like=True, gc=False):
    """A request's completions that changed in a step, as the engine has them (no text)."""

    request_id: str
    completions: list[CompletionDelta]
    finished: bool  # (all its completions)
    num_cached_tokens: int
    kv_transfer_params: KVTransferParams | None = None  # (a prefill instance's, once finished)
    prompt_logprobs: list[LogprobRow | None] | None = None  # per prompt position (None at 0); once, whole


class EngineCoreOutputs(msgspec.Struct, array_like=True, gc=False):
    """One step's outputs of one client's requests (or none: the metrics changed), the engine's
    metrics after it, and how many of the client's requests are in the running batch. The pipe
    pickles it as its msgpack encoding (msgspec, as vLLM sends its engine's outputs): a step's 64
    outputs encode and decode several times faster than pickle builds and rebuilds them."""

    outputs: list[EngineCoreOutput]
    metrics: dict  # (LLMEngine.get_metrics': counts, and a decode instance's transfer times)
    num_running: int

    def __reduce__(self):
        return _decode_engine_core_outputs, (_ENGINE_CORE_OUTPUTS_ENCODER.encode(self),)


_ENGINE_CORE_OUTPUTS_ENCODER = msgspec.msgpack.Encoder()
_ENGINE_CORE_OUTPUTS_DECODER = msgspec.msgpack.Decoder(EngineCoreOutputs)


def _decode_engine_core_outputs(data: bytes) -> EngineCoreOutputs:
    return _ENGINE_CORE_OUTPUTS_DECODER.decode(data)


@dataclass(frozen=True)
class RequestsFailed:
    """(request id, why) of the requests a step that raised failed; the engine goes on."""

    failed: list[tuple[str, str]]


@dataclass(frozen=True)
class EngineDead:
    """The engine could not start, or stopped: why."""

    error: BaseException


# ---- the step -------------------------------------------------------------------------------


@dataclass
class StepInputs:
    """What one forward computes, for B sequences: the new tokens of each (the last query_lens[b]
    of its context_lens[b] tokens), its block table, and whether its last new token is sampled."""

    token_ids: list[list[int]]
    context_lens: np.ndarray  # int64 [B], this step's tokens included
    query_lens: np.ndarray  # int64 [B]
    block_tables: list[list[int]]
    sample: np.ndarray  # bool [B]
    # copies between the GPU and host KV pools to run before the forward, in order: (to the
    # host?, source block ids, destination block ids) (engine/block_manager.py)
    kv_copies: list[tuple[bool, list[int], list[int]]] = field(default_factory=list)
    # the sequences whose prompt's log-probabilities this step computes: (sequence, top-k, the
    # prompt tokens its first len(targets) new tokens predict, each the next token's id)
    prompt_logprobs: list[tuple[int, int, list[int]]] = field(default_factory=list)
    # each block table is the one of the same row in the step before, the same or grown (a
    # request's table is only ever appended to, or replaced: Request.block_table)
    tables_continue: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.query_lens.sum())

    @property
    def is_decode(self) -> bool:
        """One new token per sequence, each sampled."""
        return self.num_tokens == self.num_seqs and bool(self.sample.all())


@dataclass
class SamplingBatch:
    """The rows of a step that sample, as plain data (one per request, in the order of the
    step's sampled positions), built by the engine: what the sampler needs of each request."""

    request_ids: list[str]
    params: list[SamplingParams]
    seeds: list[int | None]  # the seed of each request's own generator (None: the global one)
    num_output_tokens: list[int]  # (min_tokens bans EOS and stop tokens until reached)
    prompt_ids: list[list[int]] | None = None  # when any row has penalties
    output_ids: list[list[int]] | None = None
    finished_ids: list[str] = field(default_factory=list)  # gone since the last step: generators dropped
    bitmask: torch.Tensor | None = None  # [rows, vocab / 32] int32 on the host: tokens a grammar allows
    continues: bool = False  # the same requests as the batch before, none finished (its tensors serve)

    @property
    def num_rows(self) -> int:
        return len(self.request_ids)


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [B] token ids
    sampled_logprobs: torch.Tensor | None  # [B] raw log-probability of the sampled token
    sampled_ranks: torch.Tensor | None  # [B] its rank (1 = most likely)
    top_logprobs: torch.Tensor | None  # [B, max_logprobs]
    top_ids: torch.Tensor | None  # [B, max_logprobs]
    # StepInputs.prompt_logprobs' targets end to end (a step may compute them and sample nothing):
    prompt_logprobs: torch.Tensor | None = None  # [T] the target's log-probability
    prompt_ranks: torch.Tensor | None = None  # [T] its rank
    prompt_top_logprobs: torch.Tensor | None = None  # [T, the largest k]
    prompt_top_ids: torch.Tensor | None = None


@dataclass
class ModelRunnerOutput:
    """A launched step's samples on their way to the host: on a GPU, copied to pinned memory
    (non_blocking) and ready once `copied` has passed, so that reading them waits for this step
    alone, not for a step launched after it."""

    sampled: SamplerOutput
    copied: torch.cuda.Event | None

    @classmethod
    def to_host(cls, out: SamplerOutput) -> ModelRunnerOutput:
        if out.sampled.device.type != "cuda":
            return cls(out, None)

        def copy(t):
            if t is None:
                return None
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

        host = SamplerOutput(*(copy(getattr(out, f.name)) for f in fields(out)))
        copied = torch.cuda.Event()
        copied.record()
        return cls(host, copied)

    def wait(self) -> None:
        """Until the samples are on the host: the step's work, and all before it, has ended."""
        if self.copied is not None:
            self.copied.synchronize()


# ---- commands every rank runs ----------------------------------------------------------------


@dataclass(frozen=True)
class StartRank:
    """What a rank started by torchrun takes from rank 0 before loading: the engine's options."""

    engine_args: dict
    max_model_len: int


@dataclass(frozen=True)
class ExecuteStep:
    """One forward. The first num_pending rows decode tokens that the step before sampled and
    the host has not read (a step launched ahead): rank 0 takes them from its last samples (the
    rows pending_rows of them; None: all), and the other ranks receive them from rank 0."""

    step: StepInputs
    num_pending: int = 0
    pending_rows: list[int] | None = None


@dataclass(frozen=True)
class AllocateKVCache:
    num_blocks: int
    num_host_blocks: int = 0


@dataclass(frozen=True)
class CaptureGraphs:
    """Every rank captures the same graphs, in the same order (their all-reduces meet)."""

    max_num_seqs: int
    max_model_len: int
    mixed_graph_tokens: int


@dataclass(frozen=True)
class DescribeKV:
    """Answered: the rank's KV pool as a prefill or decode instance's peers see it (KVTransfer.rank_info)."""

    answers = True


@dataclass(frozen=True)
class PullKV:
    """Start pulling a prompt's KV (each rank its own heads): see KVTransfer.pull."""

    pull_id: str
    remote: dict
    remote_blocks: list[int]
    local_blocks: list[int]
    after: bool = False


@dataclass(frozen=True)
class PollKV:
    """Answered: the rank's pulls that ended since the last poll, (done ids, {failed id: why})."""

    answers = True


@dataclass(frozen=True)
class Shutdown:
    pass


WorkerCommand = ExecuteStep | AllocateKVCache | CaptureGraphs | DescribeKV | PullKV | PollKV | Shutdown


def answers(cmd: WorkerCommand) -> bool:
    """Whether the ranks answer this command (the others run without a round trip)."""
    return getattr(cmd, "answers", False)


# ---- what a rank says about itself -----------------------------------------------------------


@dataclass(frozen=True)
class WorkerJoining:
    """About to join the process group (rank 0 joins once every rank is this far)."""


@dataclass(frozen=True)
class WorkerReady:
    num_kv_blocks: int  # what this rank's device holds


@dataclass(frozen=True)
class WorkerFailed:
    message: str  # the exception, before the rank exits
