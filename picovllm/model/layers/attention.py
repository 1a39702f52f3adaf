"""Attention over the paged KV cache: store this step's K/V, then attend."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from picovllm.kernels.kv_store import store_kvcache_ref
from picovllm.kernels.paged_attention import AttentionPlan, paged_attention_ref, plan_paged_attention


class AttentionMetadata(NamedTuple):
    """Plain tensors describing one forward over B sequences (prefill or decode).

    slot_mapping [num_tokens]: cache slot of each new token (-1: padding, not stored).
    block_tables [B, max_blocks]: physical blocks of each sequence (padding entries unread).
    context_lens [B]: tokens each sequence attends to, this step's included.
    query_start_loc [B + 1]: where each sequence's new tokens start in the flat token batch.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    plan: AttentionPlan | None = None  # derived once per forward by PagedAttention.prepare


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = head_dim ** -0.5
        # Views into the BlockManager's pool, [num_blocks, block_size, num_kv_heads, head_dim];
        # bound by the model runner once the pool is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Derive once per forward what every layer's attention needs."""
        block_size = self.k_cache.shape[1]
        return meta._replace(plan=plan_paged_attention(meta.block_tables, meta.context_lens,
                                                       meta.query_start_loc, block_size))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        store_kvcache_ref(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return paged_attention_ref(q, self.k_cache, self.v_cache, meta.plan, self.scale)
