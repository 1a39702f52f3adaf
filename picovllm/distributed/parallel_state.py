"""The process groups of this process (vLLM's parallel_state): its tensor-parallel group, on
NCCL for CUDA tensors or gloo on the CPU. Without init_distributed, rank 0 of a group of one."""

from __future__ import annotations

import datetime

import torch.distributed as dist

_TP_GROUP: dist.ProcessGroup | None = None


def init_distributed(
    world_size: int, rank: int, backend: str, init_method: str = "env://", timeout_s: float = 600.0
) -> None:
    """Join the world of world_size ranks (one tensor-parallel group of all of them). init_method
    "env://" takes RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (torchrun sets them); a
    "tcp://host:port" names the rendezvous directly. A peer that does not answer a collective
    within timeout_s is an error, not a hang."""
    global _TP_GROUP
    if _TP_GROUP is not None:
        raise RuntimeError("init_distributed was called twice in this process")
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            init_method=init_method,
            world_size=world_size,
            rank=rank,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    _TP_GROUP = dist.group.WORLD


def destroy_distributed() -> None:
    global _TP_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_GROUP = None


def get_tp_group() -> dist.ProcessGroup | None:
    return _TP_GROUP


def get_tp_rank() -> int:
    return dist.get_rank(_TP_GROUP) if _TP_GROUP is not None else 0


def get_tp_size() -> int:
    return dist.get_world_size(_TP_GROUP) if _TP_GROUP is not None else 1


def check_torchrun_world(world_size: int, tensor_parallel_size: int) -> None:
    """Under torchrun every process is a rank: their number must be the tensor-parallel size (else
    some rank would wait for a process group that never forms)."""
    if world_size != tensor_parallel_size:
        raise ValueError(f"torchrun started {world_size} processes for tensor_parallel_size {tensor_parallel_size}")
