"""Runs the model on every tensor-parallel rank. Rank 0's model runner is here, in the engine's
process: it builds each step's inputs, samples, and with tensor_parallel_size > 1 first sends
the step (plain data: StepInputs) to ranks 1..N-1, each a worker process (worker/worker.py),
which run the same forward; the sampled tokens a step launched ahead decodes reach them from
rank 0 over the process group (ModelRunner.prepare). With one rank there is no process and no
message: the engine runs as it would without an executor. Under torchrun (one process a rank,
on one machine or several) the other ranks are torchrun's processes, which run
worker.torchrun_worker, and the step reaches them over a gloo group (BroadcastChannel) instead.

A worker that dies or raises makes the engine raise an error that names its rank and what it
said, as soon as a collective or a message fails to reach it; shutdown() (also when the engine
is collected, and at exit) stops every worker and leaves no process behind.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import socket
import time
import weakref

import torch

from picovllm import envs
from picovllm.config import EngineConfig, ModelConfig
from picovllm.distributed.communicator import BroadcastChannel
from picovllm.distributed.parallel_state import check_torchrun_world, destroy_distributed, init_distributed
from picovllm.engine.block_manager import BlockManager
from picovllm.engine.inputs import StepInputs
from picovllm.engine.model_runner import ModelRunner
from picovllm.model.layers.linear import check_tp_heads
from picovllm.worker.worker import worker_main

START_TIMEOUT_S = 600.0  # a worker loading a large model


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


def _stop(workers: list[_Worker], distributed: bool) -> None:
    for w in workers:
        try:
            w.conn.send(None)
        except OSError:
            pass
    deadline = time.monotonic() + 10
    for w in workers:
        w.process.join(timeout=max(0.1, deadline - time.monotonic()))
        if w.process.is_alive():
            w.process.kill()
            w.process.join(timeout=5)
    workers.clear()
    if distributed:
        destroy_distributed()


def _stop_channel(channel: BroadcastChannel) -> None:
    """Tell the workers torchrun started to stop (torchrun ends them if rank 0 cannot)."""
    try:
        channel.send(None)
    finally:
        destroy_distributed()


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
        launched = envs.torchrun_ranks()
        if tp > 1:  # before any process starts
            check_tp_heads(model_config.num_attention_heads, model_config.num_key_value_heads, tp)
        if launched is not None:
            check_torchrun_world(launched[1], tp)
        if tp > 1 and launched is not None:
            init_distributed(tp, 0, "nccl" if device.type == "cuda" else "gloo")
            self.channel = BroadcastChannel()
            self.channel.send(max_model_len)
            self._finalizer = weakref.finalize(self, _stop_channel, self.channel)
        elif tp > 1:
            one_gpu_a_rank = device.type == "cuda" and torch.cuda.device_count() >= tp
            backend = "nccl" if one_gpu_a_rank else "gloo"  # (gloo: CPU tensors, or ranks sharing a GPU)
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
            self._finalizer = weakref.finalize(self, _stop, self.workers, True)
            try:
                for w in self.workers:
                    self._expect(w, "joining")
            except WorkerError:
                self._finalizer()
                raise
            init_distributed(tp, 0, backend, init_method)
        self.driver = ModelRunner(config, model_config, path, dtype, device, max_model_len, eos_ids)
        if tp > 1:
            self.driver.publish_step = self._publish

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
        got, value = w.conn.recv()
        if got != kind:
            raise self._fail(w, "while starting", value if got == "error" else f"said {got!r}, not {kind!r}")
        return value

    def allocate_kv_cache(self, num_blocks: int) -> BlockManager:
        if self.channel is not None:
            self.channel.send(("kv", num_blocks))
        for w in self.workers:
            self._send(w, ("kv", num_blocks))
        return self.driver.allocate_kv_cache(num_blocks)

    def _publish(self, step: StepInputs, num_pending: int) -> None:
        if self.channel is not None:
            self.channel.send(("step", step, num_pending))
        for w in self.workers:
            self._send(w, ("step", step, num_pending))

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

    def run(self, batch, pending: torch.Tensor | None = None):
        """Rank 0's ModelRunner.run, the other ranks following it; a rank's failure raises WorkerError."""
        if self.error is not None:
            raise self.error
        try:
            return self.driver.run(batch, pending)
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
