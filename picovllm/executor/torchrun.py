"""ExecutorWithExternalLauncher: the ranks are torchrun's processes (one a rank, on one machine or
several), every one running the same command line: rank 0 is the engine, the others follow it
(run_torchrun_rank). Rank 0 sends its engine's configuration, then each command, over a gloo
group of all ranks (BroadcastChannel); the forwards' collectives go over NCCL on GPUs, gloo on
CPUs. A rank's failure ends its process, and torchrun the others."""

from __future__ import annotations

import dataclasses
import weakref

import torch

from picovllm import envs
from picovllm.config import EngineConfig, resolve_device
from picovllm.distributed.communicator import BroadcastChannel
from picovllm.distributed.parallel_state import check_torchrun_world, destroy_distributed, init_distributed
from picovllm.executor.executor import Executor
from picovllm.messages import Shutdown, StartRank, WorkerCommand
from picovllm.worker.worker import Worker


def _stop(channel: BroadcastChannel, drivers: list[Worker]) -> None:
    """Rank 0's graphs go before the process group; the other ranks stop at its Shutdown
    (torchrun ends them if rank 0 cannot tell them)."""
    for driver in drivers:
        driver.shutdown()
    drivers.clear()
    try:
        channel.send(Shutdown())
    finally:
        destroy_distributed()


class ExecutorWithExternalLauncher(Executor):
    def _start(self, max_model_len: int) -> None:
        if self.config.kv_role != "both":
            raise ValueError("a prefill or decode instance under torchrun is not supported: use -tp without torchrun")
        init_distributed(self.tp_size, 0, "nccl" if self._device().type == "cuda" else "gloo")
        self.channel = BroadcastChannel()
        self.channel.send(StartRank(dataclasses.asdict(self.config), max_model_len))
        self._finalizer = weakref.finalize(self, _stop, self.channel, self._drivers)

    def num_kv_blocks(self) -> int:
        return self.channel.min(self.driver.num_kv_blocks())

    def _broadcast(self, cmd: WorkerCommand) -> None:
        self.channel.send(cmd)

    def _answers(self) -> list:
        raise NotImplementedError("the ranks of a torchrun launch answer no command")

    def _stop(self) -> None:
        self._finalizer()


def run_torchrun_rank(engine_args: dict) -> int:
    """Rank r > 0 of a torchrun launch: its own options name the device and the world; it then
    takes rank 0's engine configuration and follows rank 0's commands until Shutdown (one engine
    a launch)."""
    rank, world_size, local_rank = envs.torchrun_ranks()
    config = EngineConfig(**engine_args)
    config.validate()
    check_torchrun_world(world_size, config.tensor_parallel_size)
    device = resolve_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    init_distributed(world_size, rank, "nccl" if device.type == "cuda" else "gloo")
    try:
        channel = BroadcastChannel()
        start: StartRank = channel.recv()
        worker = Worker(EngineConfig(**start.engine_args), rank, device, start.max_model_len)
        channel.min(worker.num_kv_blocks())
        worker.follow(channel.recv)
    finally:
        destroy_distributed()
    return 0
