"""The collectives of the tensor-parallel group that the model's layers call: an all-reduce of
partial sums (row-parallel layers, the vocabulary-parallel embedding) and a gather of logit
shards to the rank that samples, and the broadcast of the tokens it sampled. With a group of one
they return their input."""

from __future__ import annotations

import torch
import torch.distributed as dist

from picovllm.distributed.parallel_state import get_tp_group, get_tp_rank, get_tp_size


def tp_all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """x, in place, the elementwise largest over the group's ranks (nothing with one rank)."""
    if get_tp_size() > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=get_tp_group())
    return x


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the ranks, in place."""
    if get_tp_size() > 1:
        dist.all_reduce(x, group=get_tp_group())
    return x


class BroadcastChannel:
    """Rank 0's messages to every other rank (Python objects over a gloo group of all ranks): how
    the step reaches the workers when torchrun started them, on this machine or others."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo")

    def send(self, msg) -> None:
        """On rank 0."""
        with torch.inference_mode(False):  # (gloo's object collectives fail in inference mode)
            dist.broadcast_object_list([msg], src=0, group=self.group)

    def recv(self):
        """On the other ranks: rank 0's next message."""
        box = [None]
        with torch.inference_mode(False):
            dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def min(self, value: int) -> int:
        """The smallest value over the ranks (each passes its own)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


def tp_broadcast(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's x on every rank, in place."""
    if get_tp_size() > 1:
        dist.broadcast(x, src=dist.get_global_rank(get_tp_group(), 0), group=get_tp_group())
    return x


def tp_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """The ranks' equally shaped x concatenated along dim, on rank 0 of the group; None elsewhere."""
    size = get_tp_size()
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)] if get_tp_rank() == 0 else None
    dist.gather(x, parts, dst=dist.get_global_rank(get_tp_group(), 0), group=get_tp_group())
    return torch.cat(parts, dim=dim) if parts is not None else None
