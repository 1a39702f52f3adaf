"""Vocabulary-parallel embedding and LM head: each rank holds a slice of the vocabulary (the
slices padded to equal length; padding rows are zero and never read as tokens)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from picovllm.distributed.communicator import tp_all_reduce, tp_gather
from picovllm.distributed.parallel_state import get_tp_rank, get_tp_size
from picovllm.model.layers.linear import linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp_size)
        self.start = self.tp_rank * self.shard_size
        self.num_rows = max(0, min(self.shard_size, vocab_size - self.start))  # real rows, before the padding
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != (self.vocab_size, param.shape[1]):
            raise ValueError(
                f"shape mismatch loading the embedding: checkpoint has {tuple(loaded.shape)}, "
                f"model expects ({self.vocab_size}, {param.shape[1]})"
            )
        param.data[: self.num_rows].copy_(loaded.narrow(0, self.start, self.num_rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        in_shard = (local >= 0) & (local < self.num_rows)
        y = F.embedding(torch.where(in_shard, local, 0), self.weight) * in_shard[:, None]
        return tp_all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the given hidden states only (the caller selects the sampled positions), after
    the model's final norm (fused into the head at decode batch 1 on the GPU). With tensor
    parallelism each rank computes its vocabulary slice and rank 0, which samples, gathers them;
    the other ranks return None."""

    def forward(self, hidden: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor | None:
        logits = linear(hidden, self.weight, norm=norm)
        if self.tp_size == 1:
            return logits
        full = tp_gather(logits)
        return None if full is None else full[:, : self.vocab_size]
