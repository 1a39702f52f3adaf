"""Runs each step on every tensor-parallel rank: engine -> executor -> every rank's Worker.

The executor is transport only. Every rank has a Worker (worker/worker.py); rank 0's, which
samples, lives in the engine's process (`driver`). A command (messages.py) goes to ranks
1..N-1 first, then rank 0 runs the very same command (collective_rpc), so that all ranks run one
forward together, their collectives meeting; the tokens a step launched ahead decodes reach the
other ranks from rank 0 over the process group (ModelRunner.prepare). Three transports:

    UniProcExecutor               one rank: no process and no message
    MultiprocExecutor             ranks 1..N-1 spawned here, commands over pipes (multiproc.py)
    ExecutorWithExternalLauncher  ranks started by torchrun, on one machine or several,
                                  commands over a gloo group (torchrun.py)

A rank that dies or raises makes the engine raise a WorkerError that names it and what it said,
as soon as a collective or a message fails to reach it; shutdown() (also when the engine is
collected, and at exit) stops every rank and leaves no process behind.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from picovllm import envs
from picovllm.config import EngineConfig, ModelConfig, check_tp_heads, resolve_device
from picovllm.distributed.kv_transfer import KVTransfer, LeaseNotice
from picovllm.distributed.parallel_state import check_torchrun_world, get_tp_group
from picovllm.messages import (
    AllocateKVCache,
    CaptureGraphs,
    DescribeKV,
    ExecuteStep,
    ModelRunnerOutput,
    PollKV,
    PullKV,
    SamplingBatch,
    WorkerCommand,
    answers,
)
from picovllm.worker.worker import Worker

logger = logging.getLogger("picovllm")


class WorkerError(RuntimeError):
    pass


class Executor:
    """What the engine asks of the ranks. A transport (a subclass) starts ranks 1..N-1 before
    rank 0's Worker loads (_start), sends them each command (_broadcast), collects the answers of
    a command that answers (_answers), and names a rank that failed (_rank_failure)."""

    graphs_capturable = True  # CUDA graphs capture NCCL's collectives, not gloo's

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int, eos_ids: set[int]):
        self.config, self.tp_size = config, config.tensor_parallel_size
        self.error: WorkerError | None = None
        if (group := get_tp_group()) is not None:  # (its collectives would wait on another engine's ranks)
            raise ValueError(
                f"this process holds a tensor-parallel engine already (tensor_parallel_size "
                f"{group.size()}); shut it down (LLM.shutdown()) before starting another"
            )
        if self.tp_size > 1:  # before any process starts
            check_tp_heads(model_config.num_attention_heads, model_config.num_key_value_heads, self.tp_size)
        if (launched := envs.torchrun_ranks()) is not None:
            check_torchrun_world(launched[1], self.tp_size)
        self._drivers: list[Worker] = []  # rank 0's once loaded (a transport's shutdown frees its graphs first)
        self._start(max_model_len)
        self.driver = Worker(config, 0, self._device(), max_model_len, eos_ids)
        self._drivers.append(self.driver)
        self._ranked: _RankedKVTransfer | None = None

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        """The transport for this configuration."""
        if config.tensor_parallel_size == 1:
            return UniProcExecutor
        if envs.torchrun_ranks() is not None:
            from picovllm.executor.torchrun import ExecutorWithExternalLauncher

            return ExecutorWithExternalLauncher
        from picovllm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor

    # ---- the transport ---------------------------------------------------------------------

    def _start(self, max_model_len: int) -> None:
        pass

    def _device(self) -> torch.device:
        """Rank 0's."""
        return resolve_device(self.config.device)

    def _broadcast(self, cmd: WorkerCommand) -> None:
        pass

    def _answers(self) -> list:
        return []

    def _rank_failure(self) -> WorkerError | None:
        return None

    def _stop(self) -> None:
        self.driver.shutdown()

    # ---- what the engine asks ----------------------------------------------------------------

    def _run(self, cmd: WorkerCommand, on_rank0: Callable[[], object]) -> list:
        """cmd on every rank, rank 0 last (on_rank0); the ranks' answers in rank order for a
        command that answers, else rank 0's result alone. A rank's failure raises WorkerError."""
        if self.error is not None:
            raise self.error
        try:
            self._broadcast(cmd)
            mine = on_rank0()
            return [mine, *self._answers()] if answers(cmd) else [mine]
        except WorkerError:
            raise
        except Exception as e:
            if (failed := self._rank_failure()) is not None:  # a collective that failed: which rank, and why
                raise failed from e
            raise

    def collective_rpc(self, cmd: WorkerCommand) -> list:
        return self._run(cmd, lambda: self.driver.handle(cmd))

    def execute_step(
        self,
        cmd: ExecuteStep,
        sampling: SamplingBatch | None,
        defer: bool = False,
        bitmask: Callable[[], torch.Tensor | None] | None = None,
    ) -> tuple[ModelRunnerOutput | None, ModelRunnerOutput | None]:
        """One step on every rank; rank 0 samples `sampling`'s rows (Worker.execute_step), or
        with defer keeps their logits for sample_deferred. With bitmask, rank 0 first samples the
        step executed with defer under bitmask() once this step's inputs are built. Returns (that
        step's samples, None without bitmask; this step's)."""
        return self._run(cmd, lambda: self.driver.execute_step(cmd, sampling, defer, bitmask))[0]

    def sample_deferred(self, bitmask) -> ModelRunnerOutput:
        """Rank 0 samples the step executed with defer, under bitmask (its grammars')."""
        return self.driver.sample_deferred(bitmask)

    def num_kv_blocks(self) -> int:
        """The KV blocks every rank can hold (each sizes its pool from its own device's memory)."""
        return self.driver.num_kv_blocks()

    def allocate_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        self.collective_rpc(AllocateKVCache(num_blocks, num_host_blocks))

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, mixed_graph_tokens: int) -> float | None:
        """CUDA graphs on every rank, on a GPU unless enforce_eager: seconds of rank 0's capture
        (None: none, and the steps run eagerly)."""
        if self._device().type != "cuda" or self.config.enforce_eager:
            return None
        if not self.graphs_capturable:
            logger.warning("tensor-parallel ranks sharing a GPU talk over gloo, which graphs cannot capture: eager")
            return None
        if not self.driver.graphs_supported():
            # the PyTorch reference path syncs (nonzero, data-dependent shapes): not capturable
            logger.warning("CUDA graphs need the Triton kernels (disabled or missing): running eager")
            return None
        return self.collective_rpc(CaptureGraphs(max_num_seqs, max_model_len, mixed_graph_tokens))[0]

    @property
    def kv_transfer(self) -> KVTransfer | None:
        """The KV transfer of a prefill or decode instance: rank 0's, or with other ranks every rank's."""
        mine = self.driver.model_runner.kv_transfer
        if mine is None or self.tp_size == 1:
            return mine
        if self._ranked is None:
            self._ranked = _RankedKVTransfer(self, mine)
        return self._ranked

    # ---- rank 0's own ------------------------------------------------------------------------

    def kv_block_bytes(self) -> int:
        """Bytes of one block of rank 0's KV pool (its KV heads), K and V of every layer."""
        return self.driver.model_runner.kv_block_bytes()

    @property
    def weights_fingerprint(self) -> str:
        return self.driver.model_runner.model.weights_fingerprint

    def free_requests(self, request_ids: list[str]) -> None:
        """Forget finished requests' sampling state (rank 0's: it samples)."""
        self.driver.model_runner.free_requests(request_ids)

    def check_host_copies(self, copied: list[tuple[int, int]], recomputed: list[tuple[int, int]]) -> None:
        self.driver.model_runner.check_host_copies(copied, recomputed)

    def shutdown(self) -> None:
        self._stop()


class UniProcExecutor(Executor):
    """One rank, in this process: a command is a call."""


class _RankedKVTransfer(KVTransfer):
    """Every rank's KV transfer as one: the ranks' pools described together; a pull started on
    every rank (each its own heads) and ended when all have ended (a failure reported only then:
    the other ranks may still be writing the blocks); lease notices on rank 0."""

    def __init__(self, executor: Executor, driver: KVTransfer):
        self.executor, self.driver = executor, driver
        self.info: dict | None = None
        self.ended: dict[str, list[str | None]] = {}  # pull id -> each rank's failure (None: done) so far

    def register(self, kv_cache: torch.Tensor) -> None:
        raise NotImplementedError("each rank registers its own pool")

    def agent_info(self) -> dict:
        if self.info is None:
            self.info = {"ranks": self.executor.collective_rpc(DescribeKV())}
        return self.info

    def pull(self, pull_id, remote: dict, remote_blocks: list[int], local_blocks: list[int], after=False) -> None:
        self.executor.collective_rpc(PullKV(pull_id, remote, remote_blocks, local_blocks, after))

    def poll(self) -> tuple[list[str], dict[str, str]]:
        answers = self.executor.collective_rpc(PollKV())
        for done_ids, failed_ids in answers:
            for pull_id in done_ids:
                self.ended.setdefault(pull_id, []).append(None)
            for pull_id, why in failed_ids.items():
                self.ended.setdefault(pull_id, []).append(why)
        done, failed = [], {}
        for pull_id, ends in list(self.ended.items()):
            if len(ends) == len(answers):
                del self.ended[pull_id]
                why = next((e for e in ends if e is not None), None)
                if why is None:
                    done.append(pull_id)
                else:
                    failed[pull_id] = why
        return done, failed

    def notify(self, remote: dict, notice: LeaseNotice) -> None:
        self.driver.notify(remote, notice)

    def notices(self) -> list[LeaseNotice]:
        return self.driver.notices()

    def stats(self) -> dict[str, int]:
        return self.driver.stats()

    def close(self) -> None:
        self.driver.close()  # (the other ranks close theirs as they stop)
