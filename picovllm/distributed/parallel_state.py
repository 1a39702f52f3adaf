"""Tensor-parallel group state. Without torch.distributed initialised, rank 0 of 1."""

import torch.distributed as dist


def get_tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
