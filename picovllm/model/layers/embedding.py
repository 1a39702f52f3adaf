"""Vocabulary-parallel embedding and LM head (each rank holds a slice of the vocabulary)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from picovllm.distributed.parallel_state import get_tp_rank, get_tp_size
from picovllm.model.layers.linear import linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp_size)
        self.start = self.tp_rank * self.shard_size
        rows = min(self.shard_size, vocab_size - self.start)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = loaded.narrow(0, self.start, param.shape[0])
        if shard.shape != param.shape or loaded.shape[0] != self.vocab_size:
            raise ValueError(
                f"shape mismatch loading the embedding: checkpoint has {tuple(loaded.shape)}, "
                f"model expects ({self.vocab_size}, {param.shape[1]})"
            )
        param.data.copy_(shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        in_shard = (local >= 0) & (local < self.weight.shape[0])
        y = F.embedding(torch.where(in_shard, local, 0), self.weight) * in_shard[:, None]
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the given hidden states only (the caller selects the sampled positions), after
    the model's final norm (fused into the head at decode batch 1 on the GPU)."""

    def forward(self, hidden: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        logits = linear(hidden, self.weight, norm=norm)
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
        dist.all_gather(parts, logits)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]
