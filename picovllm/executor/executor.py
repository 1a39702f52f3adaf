"""Runs each step on every tensor-parallel rank: engine -> executor -> workers -> model runners.
Rank 0's model runner is here, in the engine's process, and samples; with
tensor_parallel_size > 1 the executor first sends the step (plain data: StepInputs) to ranks
1..N-1, each a worker process (worker/worker.py), which run the same forward; the sampled
tokens a step launched ahead decodes reach them from rank 0 over the process group
(ModelRunner.prepare). With one rank there is no process and no message: the engine runs as it
would without an executor. Under torchrun (one process a rank, on one machine or several) the
other ranks are torchrun's processes, which run worker.torchrun_worker, and the step reaches
them over a gloo group (BroadcastChannel) instead.

A worker that dies or raises makes the engine raise an error that names its rank and what it
said, as soon as a collective or a message fails to reach it; shutdown() (also when the engine
is collected, and at exit) stops every worker and leaves no process behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import socket
import time
import weakref

import torch

from picovllm import envs
from picovllm.config import EngineConfig, ModelConfig
from picovllm.distributed.communicator import BroadcastChannel
from picovllm.distributed.kv_transfer import KVTransfer, LeaseNotice
from picovllm.distributed.parallel_state import check_torchrun_world, destroy_distributed, init_distributed
from picovllm.model.layers.linear import check_tp_heads
from picovllm.worker.inputs import StepInputs
from picovllm.worker.model_runner import ModelRunner
from picovllm.worker.sampler import SamplerOutput, SamplingBatch
from picovllm.worker.worker import worker_main

START_TIMEOUT_S = 600.0  # a worker loading a large model
STOP_GRACE_S = 5.0  # a worker told to stop exits in well under a second, unless stuck in a collective


class WorkerError(RuntimeError):
    pass


@dataclasses.dataclass
class _Worker:
    rank: int
    process: multiprocessing.Process
    conn: object

    def failure(self) -> str:
        """What the worker said before it stopped, or how it exited."""
        try:
            if self.conn.poll(0.5):
                msg = self.conn.recv()
                if msg[0] == "error":
                    return msg[1]
        except (EOFError, OSError):
            pass
        self.process.join(timeout=5)
        code = self.process.exitcode
        return "still running" if code is None else f"exited with code {code}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(workers: list[_Worker], runners: list[ModelRunner], channel: BroadcastChannel | None) -> None:
    """Stop the ranks: rank 0's CUDA graphs go before the process group (one holding NCCL's work
    hung at exit otherwise); the workers are told to stop (torchrun's by rank 0's None: torchrun
    ends them if rank 0 cannot tell them), then rank 0 leaves the process group, which ends the
    collective a worker may be waiting in (rank 0 interrupted mid-step: Ctrl-C) or not (gloo may
    wait on): the workers are waited for STOP_GRACE_S, then killed."""
    for runner in runners:
        runner.free_graphs()
    runners.clear()
    try:
        if channel is not None:
            channel.send(None)
        for w in workers:
            with contextlib.suppress(OSError):
                w.conn.send(None)
    finally:
        destroy_distributed()
        _join(workers)


def _join(workers: list[_Worker]) -> None:
    deadline = time.monotonic() + STOP_GRACE_S
    for w in workers:
        w.process.join(timeout=max(0.1, deadline - time.monotonic()))
        if w.process.is_alive():
            w.process.kill()
            w.process.join(timeout=5)
    workers.clear()


class Executor:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        path: str | None,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        eos_ids: set[int],
    ):
        self.tp_size = tp = config.tensor_parallel_size
        self.workers: list[_Worker] = []
        self.channel: BroadcastChannel | None = None  # to the workers torchrun started
        self.error: WorkerError | None = None
        self.graphs_capturable = True  # CUDA graphs capture NCCL's collectives, not gloo's
        self._runners: list[ModelRunner] = []  # rank 0's, once loaded (for _stop)
        self._ranked: _RankedKVTransfer | None = None
        launched = envs.torchrun_ranks()
        if tp > 1:  # before any process starts
            check_tp_heads(model_config.num_attention_heads, model_config.num_key_value_heads, tp)
        if launched is not None:
            check_torchrun_world(launched[1], tp)
        if tp > 1 and launched is not None:
            if config.kv_role != "both":
                raise ValueError(
                    "a prefill or decode instance under torchrun is not supported: use -tp without torchrun"
                )
            init_distributed(tp, 0, "nccl" if device.type == "cuda" else "gloo")
            self.channel = BroadcastChannel()
            self.channel.send((dataclasses.asdict(config), max_model_len))
            self._finalizer = weakref.finalize(self, _stop, self.workers, self._runners, self.channel)
        elif tp > 1:
            one_gpu_a_rank = device.type == "cuda" and torch.cuda.device_count() >= tp
            backend = "nccl" if one_gpu_a_rank else "gloo"  # (gloo: CPU tensors, or ranks sharing a GPU)
            self.graphs_capturable = backend == "nccl"
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            ctx = multiprocessing.get_context("spawn")
            args = dataclasses.asdict(config)
            for rank in range(1, tp):
                conn, child = ctx.Pipe()
                process = ctx.Process(
                    target=worker_main,
                    args=(rank, tp, init_method, backend, args, max_model_len, child),
                    name=f"picovllm-tp{rank}",
                )
                process.start()
                child.close()
                self.workers.append(_Worker(rank, process, conn))
            self._finalizer = weakref.finalize(self, _stop, self.workers, self._runners, None)
            try:
                for w in self.workers:
                    self._expect(w, "joining")
            except WorkerError:
                self._finalizer()
                raise
            init_distributed(tp, 0, backend, init_method)
        self.driver = ModelRunner(config, model_config, path, dtype, device, max_model_len, eos_ids)
        self._runners.append(self.driver)

    def num_kv_blocks(self, config: EngineConfig) -> int:
        """The KV blocks every rank can hold (each sizes its pool from its own device's memory)."""
        if self.channel is not None:
            return self.channel.min(self.driver.num_kv_blocks(config))
        counts = [self.driver.num_kv_blocks(config)]
        for w in self.workers:
            counts.append(self._expect(w, "ready"))
        return min(counts)

    def _expect(self, w: _Worker, kind: str):
        """The value of the worker's next message, which must be of this kind."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not w.conn.poll(0.1):
            if not w.process.is_alive() or time.monotonic() > deadline:
                raise self._fail(w, "while starting")
        try:
            got, value = w.conn.recv()
        except (EOFError, OSError):
            raise self._fail(w, "while starting") from None
        if got != kind:
            raise self._fail(w, "while starting", value if got == "error" else f"said {got!r}, not {kind!r}")
        return value

    def allocate_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        self._publish(("kv", num_blocks, num_host_blocks))
        self.driver.allocate_kv_cache(num_blocks, num_host_blocks)

    @property
    def kv_transfer(self) -> KVTransfer | None:
        """The KV transfer of a prefill or decode instance: rank 0's, or with workers every rank's."""
        if self.driver.kv_transfer is None or not self.workers:
            return self.driver.kv_transfer
        if self._ranked is None:
            self._ranked = _RankedKVTransfer(self)
        return self._ranked

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, mixed_graph_tokens: int) -> float:
        """Every rank captures the same graphs, in the same order (their all-reduces meet)."""
        self._publish(("graphs", max_num_seqs, max_model_len, mixed_graph_tokens))
        return self.driver.capture_graphs(max_num_seqs, max_model_len, mixed_graph_tokens)

    def _publish(self, msg) -> None:
        if self.channel is not None:
            self.channel.send(msg)
        for w in self.workers:
            self._send(w, msg)

    def _send(self, w: _Worker, msg) -> None:
        try:
            w.conn.send(msg)
        except OSError:
            raise self._fail(w) from None

    def _fail(self, w: _Worker, when: str = "", said: str | None = None) -> WorkerError:
        self.error = WorkerError(
            f"tensor-parallel rank {w.rank} failed{' ' + when if when else ''}: {said or w.failure()}"
        )
        return self.error

    def run(
        self, step: StepInputs, sampling: SamplingBatch | None, pending: torch.Tensor | None = None
    ) -> SamplerOutput | None:
        """One step on every rank: the step goes to ranks 1..N-1, then rank 0 runs it and samples
        (ModelRunner.run). A rank's failure raises WorkerError."""
        if self.error is not None:
            raise self.error
        try:
            if self.tp_size > 1:
                self._publish(("step", step, 0 if pending is None else len(pending)))
            return self.driver.run(step, sampling, pending)
        except WorkerError:
            raise
        except Exception as e:
            if not self.workers:
                raise
            for w in self.workers:  # a collective that failed: which rank stopped, and why
                if not w.process.is_alive() or w.conn.poll(0):
                    raise self._fail(w) from e
            raise

    def shutdown(self) -> None:
        if self.tp_size > 1:
            self._finalizer()


class _RankedKVTransfer(KVTransfer):
    """Every rank's KV transfer as one: the ranks' pools described together; a pull started on
    every rank (each its own heads) and ended when all have ended (a failure reported only then:
    the other ranks may still be writing the blocks); lease notices on rank 0."""

    def __init__(self, executor: Executor):
        self.executor, self.driver = executor, executor.driver.kv_transfer
        self.info: dict | None = None
        self.ended: dict[str, list[str | None]] = {}  # pull id -> each rank's failure (None: done) so far

    def register(self, kv_cache: torch.Tensor) -> None:
        raise NotImplementedError("each rank registers its own pool")

    def agent_info(self) -> dict:
        if self.info is None:
            ranks = [self.driver.rank_info()]
            for w in self.executor.workers:
                self.executor._send(w, ("kv_info",))
                ranks.append(self.executor._expect(w, "kv_info"))
            self.info = {"ranks": ranks}
        return self.info

    def pull(self, pull_id, remote: dict, remote_blocks: list[int], local_blocks: list[int], after=False) -> None:
        self.executor._publish(("kv_pull", pull_id, remote, remote_blocks, local_blocks, after))
        self.driver.pull(pull_id, remote, remote_blocks, local_blocks, after)

    def poll(self) -> tuple[list[str], dict[str, str]]:
        answers = [self.driver.poll()]
        for w in self.executor.workers:
            self.executor._send(w, ("kv_poll",))
            answers.append(self.executor._expect(w, "kv_poll"))
        done, failed = [], {}
        for done_ids, failed_ids in answers:
            for pull_id in done_ids:
                self.ended.setdefault(pull_id, []).append(None)
            for pull_id, why in failed_ids.items():
                self.ended.setdefault(pull_id, []).append(why)
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
        self.driver.close()  # (the workers close theirs as they stop)
