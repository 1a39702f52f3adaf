"""One tensor-parallel rank: its device, its shard of the model and of the KV cache, in a model
runner. Every rank has a Worker with the same methods: rank 0's lives in the engine's process
and also samples; the others' in processes of their own, which run the commands rank 0 sends
(messages.py) as they come (follow). How the commands travel is the executor's (executor/).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from picovllm.config import EngineConfig, resolve_device, resolve_dtype
from picovllm.kernels import triton_utils
from picovllm.messages import (
    AllocateKVCache,
    CaptureGraphs,
    DescribeKV,
    ExecuteStep,
    ModelRunnerOutput,
    PollKV,
    PullKV,
    SamplerOutput,
    SamplingBatch,
    Shutdown,
    WorkerCommand,
    answers,
)
from picovllm.model_source import resolve_model
from picovllm.worker.model_runner import ModelRunner
from picovllm.worker.sampler import to_device


def worker_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r's device in a process of its own: GPU r (modulo the GPUs there are), or the CPU."""
    device = resolve_device(config.device)
    if device.type == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return device


class Worker:
    def __init__(
        self, config: EngineConfig, rank: int, device: torch.device, max_model_len: int, eos_ids: set[int] = frozenset()
    ):
        """rank 0 samples (eos_ids: what min_tokens bans); the others never do."""
        self.config, self.rank = config, rank
        model_config, path = resolve_model(config.model)
        torch.manual_seed(config.seed)
        dtype = resolve_dtype(config.dtype, model_config.torch_dtype)
        self.model_runner = ModelRunner(config, model_config, path, dtype, device, max_model_len, set(eos_ids))
        self._sampled: torch.Tensor | None = None  # rank 0: the last step's samples, on the device

    # ---- what the engine asks of every rank --------------------------------------------------

    def handle(self, cmd: WorkerCommand):
        """Run one of rank 0's commands; returns the answer of one that answers."""
        runner = self.model_runner
        match cmd:
            case ExecuteStep():
                return self.execute_step(cmd)
            case AllocateKVCache(num_blocks, num_host_blocks):
                return runner.allocate_kv_cache(num_blocks, num_host_blocks)
            case CaptureGraphs(max_num_seqs, max_model_len, mixed_graph_tokens):
                return runner.capture_graphs(max_num_seqs, max_model_len, mixed_graph_tokens)
            case DescribeKV():
                return runner.kv_transfer.rank_info()
            case PullKV(pull_id, remote, remote_blocks, local_blocks, after):
                return runner.kv_transfer.pull(pull_id, remote, remote_blocks, local_blocks, after)
            case PollKV():
                return runner.kv_transfer.poll()
        raise TypeError(f"not a worker command: {cmd!r}")

    def execute_step(
        self,
        cmd: ExecuteStep,
        sampling: SamplingBatch | None = None,
        defer: bool = False,
        bitmask: Callable[[], torch.Tensor | None] | None = None,
    ) -> tuple[ModelRunnerOutput | None, ModelRunnerOutput | None]:
        """The step's forward; on rank 0 (sampling: its rows) the samples too, on their way to the
        host, unless defer: then they wait for sample_deferred. The pending rows' tokens are rank
        0's last samples (ExecuteStep). With bitmask (rank 0), the step run with defer samples
        under bitmask() first, once this step's inputs are built: (its samples, this step's)."""
        before = None

        def pending() -> torch.Tensor | None:  # (ModelRunner.prepare: after the inputs, before the forward)
            nonlocal before
            if bitmask is not None:
                before = self.sample_deferred(bitmask())
            if not cmd.num_pending or self._sampled is None:
                return None
            if cmd.pending_rows is None:
                return self._sampled
            return self._sampled[to_device(cmd.pending_rows, torch.long, self._sampled.device)]

        out = self.model_runner.run(cmd.step, sampling, pending, cmd.num_pending, defer)
        return before, None if out is None else self._sampled_out(out)

    def sample_deferred(self, bitmask: torch.Tensor | None) -> ModelRunnerOutput:
        """Rank 0: the samples of the step run with defer, under its grammars' bitmask."""
        return self._sampled_out(self.model_runner.sample_deferred(bitmask))

    def _sampled_out(self, out: SamplerOutput) -> ModelRunnerOutput:
        self._sampled = out.sampled
        return ModelRunnerOutput.to_host(out)

    def num_kv_blocks(self) -> int:
        return self.model_runner.num_kv_blocks(self.config)

    @staticmethod
    def graphs_supported() -> bool:
        """Whether the forward can be captured: the Triton kernels, not the PyTorch references."""
        return triton_utils.ENABLED and triton_utils.HAS_TRITON

    def follow(self, recv: Callable[[], WorkerCommand], reply: Callable[[object], None] | None = None) -> None:
        """Run rank 0's commands until its Shutdown, answering those that answer through reply.
        The graphs are freed before the process group is (a graph holding NCCL's work hung at
        exit otherwise)."""
        try:
            while not isinstance(cmd := recv(), Shutdown):
                answer = self.handle(cmd)
                if answers(cmd):
                    reply(answer)
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        self.model_runner.free_graphs()
        if self.model_runner.kv_transfer is not None:
            self.model_runner.kv_transfer.close()
