"""MultiprocExecutor: ranks 1..N-1 spawned by the engine's process, one process each, on this
machine: commands over a pipe each (messages.py), their forwards' collectives over NCCL (one GPU
a rank) or gloo (CPU tensors, or ranks sharing a GPU).

A rank process says WorkerJoining as it joins the process group, WorkerReady once its model is
loaded, then runs rank 0's commands until Shutdown (Worker.follow); WorkerFailed before it exits
on an exception.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import signal
import socket
import time
import weakref

import torch

from picovllm.config import EngineConfig
from picovllm.distributed.parallel_state import destroy_distributed, init_distributed
from picovllm.executor.executor import Executor, WorkerError
from picovllm.logger import configure_logging
from picovllm.messages import Shutdown, WorkerCommand, WorkerFailed, WorkerJoining, WorkerReady
from picovllm.worker.worker import Worker, worker_device

START_TIMEOUT_S = 600.0  # a rank loading a large model
STOP_GRACE_S = 5.0  # a rank told to stop exits in well under a second, unless stuck in a collective


@dataclasses.dataclass
class _Rank:
    """A rank's process, and the pipe to it."""

    rank: int
    process: multiprocessing.Process
    conn: object

    def failure(self) -> str:
        """What the rank said before it stopped, or how it exited."""
        try:
            if self.conn.poll(0.5):
                msg = self.conn.recv()
                if isinstance(msg, WorkerFailed):
                    return msg.message
        except (EOFError, OSError):
            pass
        self.process.join(timeout=5)
        code = self.process.exitcode
        return "still running" if code is None else f"exited with code {code}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(ranks: list[_Rank], drivers: list[Worker]) -> None:
    """Stop the ranks: rank 0's CUDA graphs go before the process group (one holding NCCL's work
    hung at exit otherwise); the ranks are told to stop, then rank 0 leaves the process group,
    which ends the collective a rank may be waiting in (rank 0 interrupted mid-step: Ctrl-C) or
    not (gloo may wait on): the ranks are waited for STOP_GRACE_S, then killed."""
    for driver in drivers:
        driver.shutdown()
    drivers.clear()
    try:
        for r in ranks:
            with contextlib.suppress(OSError):
                r.conn.send(Shutdown())
    finally:
        destroy_distributed()
        deadline = time.monotonic() + STOP_GRACE_S
        for r in ranks:
            r.process.join(timeout=max(0.1, deadline - time.monotonic()))
            if r.process.is_alive():
                r.process.kill()
                r.process.join(timeout=5)
        ranks.clear()


class MultiprocExecutor(Executor):
    def _start(self, max_model_len: int) -> None:
        tp, device = self.tp_size, self._device()
        one_gpu_a_rank = device.type == "cuda" and torch.cuda.device_count() >= tp
        backend = "nccl" if one_gpu_a_rank else "gloo"
        self.graphs_capturable = backend == "nccl"
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = multiprocessing.get_context("spawn")
        args = dataclasses.asdict(self.config)
        self.workers: list[_Rank] = []
        for rank in range(1, tp):
            conn, child = ctx.Pipe()
            process = ctx.Process(
                target=_rank_main,
                args=(rank, tp, init_method, backend, args, max_model_len, child),
                name=f"picovllm-tp{rank}",
            )
            process.start()
            child.close()
            self.workers.append(_Rank(rank, process, conn))
        self._finalizer = weakref.finalize(self, _stop, self.workers, self._drivers)
        try:
            for r in self.workers:
                self._expect(r, WorkerJoining)
        except WorkerError:
            self._finalizer()
            raise
        init_distributed(tp, 0, backend, init_method)

    def num_kv_blocks(self) -> int:
        counts = [self.driver.num_kv_blocks()]
        counts += [self._expect(r, WorkerReady).num_kv_blocks for r in self.workers]
        return min(counts)

    def _expect(self, r: _Rank, kind: type):
        """The rank's next message, which must be of this kind."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not r.conn.poll(0.1):
            if not r.process.is_alive() or time.monotonic() > deadline:
                raise self._fail(r, "while starting")
        try:
            msg = r.conn.recv()
        except (EOFError, OSError):
            raise self._fail(r, "while starting") from None
        if not isinstance(msg, kind):
            said = msg.message if isinstance(msg, WorkerFailed) else f"said {msg!r}, not {kind.__name__}"
            raise self._fail(r, "while starting", said)
        return msg

    def _broadcast(self, cmd: WorkerCommand) -> None:
        for r in self.workers:
            try:
                r.conn.send(cmd)
            except OSError:
                raise self._fail(r) from None

    def _answers(self) -> list:
        out = []
        for r in self.workers:
            try:
                out.append(r.conn.recv())
            except (EOFError, OSError):
                raise self._fail(r) from None
        return out

    def _rank_failure(self) -> WorkerError | None:
        for r in self.workers:
            if not r.process.is_alive() or r.conn.poll(0):
                return self._fail(r)
        return None

    def _fail(self, r: _Rank, when: str = "", said: str | None = None) -> WorkerError:
        self.error = WorkerError(
            f"tensor-parallel rank {r.rank} failed{' ' + when if when else ''}: {said or r.failure()}"
        )
        return self.error

    def _stop(self) -> None:
        self._finalizer()


def _stopping(conn) -> bool:
    """Whether rank 0's next message is its Shutdown, or rank 0 is gone."""
    try:
        return conn.poll(0) and isinstance(conn.recv(), Shutdown)
    except (EOFError, OSError):
        return True


def _rank_main(
    rank: int, world_size: int, init_method: str, backend: str, engine_args: dict, max_model_len: int, conn
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it stops the ranks
    configure_logging()  # (at the level of the command that started it, if one did)
    try:
        config = EngineConfig(**engine_args)
        device = worker_device(config, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        conn.send(WorkerJoining())  # (rank 0 joins the process group once every rank is this far)
        init_distributed(world_size, rank, backend, init_method)
        worker = Worker(config, rank, device, max_model_len)
        conn.send(WorkerReady(worker.num_kv_blocks()))
        worker.follow(conn.recv, conn.send)
    except EOFError:  # rank 0 went away
        return
    except BaseException as e:
        if _stopping(conn):  # rank 0 left the process group mid-step, and said so: not a failure
            return
        with contextlib.suppress(OSError):
            conn.send(WorkerFailed(f"{type(e).__name__}: {e}"))
        raise
    finally:
        destroy_distributed()
