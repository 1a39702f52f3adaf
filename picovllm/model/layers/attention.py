"""Attention over the paged KV cache: rotate this step's queries and keys, store K/V, then attend
(at decode batch 1 on the GPU the QKV projection does the first two: model/qwen2.py)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from picovllm.kernels.decode_attention import decode_attention_triton
from picovllm.kernels.kv_store import rope_and_store, rope_and_store_triton
from picovllm.kernels.paged_attention import AttentionPlan, paged_attention_ref, plan_paged_attention
from picovllm.kernels.prefill_attention import BLOCK_M as PREFILL_BLOCK_M
from picovllm.kernels.prefill_attention import num_work_items, prefill_attention_triton, prefill_work
from picovllm.kernels.triton_utils import use_triton
from picovllm.model.layers.linear import cpu_gemm


class AttentionMetadata(NamedTuple):
    """Plain tensors describing one forward over B sequences (prefill or decode).

    slot_mapping [num_tokens]: cache slot of each new token (-1: padding, not stored).
    block_tables [B, max_blocks]: physical blocks of each sequence (padding entries unread).
    context_lens [B]: tokens each sequence attends to, this step's included.
    query_start_loc [B + 1]: where each sequence's new tokens start in the flat token batch.
    max_query_len, max_context_len: host-side bounds of the above (no device sync to read them;
    a CUDA graph of decode passes 1 and max_model_len).
    any_single_query: whether some sequence computes exactly one token (mixed steps send those
    to the decode kernel).
    prefill_work: the prefill kernel's work list (kernels/prefill_attention.prefill_work: the
    query blocks of the sequences with several queries, padded with -1 in CUDA graphs).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_context_len: int
    plan: AttentionPlan | None = None  # the reference path's, derived once per forward by prepare()
    any_single_query: bool = True  # some sequence has exactly one query (host-side; mixed graphs: per graph)
    prefill_work: torch.Tensor | None = None  # None: the kernel builds it (a device-to-host copy)


# ---- the metadata's parts that follow the kernels' tiling: a step's input builder
# (worker/inputs.py) and the CUDA graphs (worker/cuda_graph.py) ask these, not the kernels


def prefill_work_items(query_lens: np.ndarray) -> int:
    """Work items of the prefill kernel a step of these query lengths gives, in a CUDA graph's
    fixed blocks of queries."""
    return num_work_items(query_lens, PREFILL_BLOCK_M)


def prefill_work_capacity(tokens: int, max_prefills: int) -> int:
    """Work items a graph of this token count holds: any step with at most max_prefills sequences
    of several queries."""
    return -(-tokens // PREFILL_BLOCK_M) + max_prefills


def prefill_work_list(query_lens: np.ndarray, capacity: int | None = None) -> np.ndarray:
    """The prefill kernel's work list; in a CUDA graph (capacity: its work items) padded with -1."""
    return prefill_work(query_lens, PREFILL_BLOCK_M, capacity=capacity)


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, first_kv_head: int = 0):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.first_kv_head = first_kv_head  # its cache's heads: the model's [first, first + num_kv_heads)
        self.scale = head_dim**-0.5
        # Views into the BlockManager's pool, [num_blocks, block_size, num_kv_heads, head_dim];
        # bound by the model runner once the pool is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # An FP8 cache's scales (the checkpoint's k_scale and v_scale, else 1.0 as vLLM's): it holds
        # K / k_scale and V / v_scale (kernels/kv_store.py); a cache in the model's dtype ignores them.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def kv_scales(self) -> tuple[float, float]:
        """(k_scale, v_scale) as the cache applies them: ones unless it is FP8."""
        return (self.k_scale, self.v_scale) if self.k_cache.dtype == torch.float8_e4m3fn else (1.0, 1.0)

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Derive once per forward what every layer's attention needs (the reference path's plan;
        the Triton kernels read the metadata directly)."""
        if use_triton(meta.slot_mapping):
            return meta
        return meta._replace(
            plan=plan_paged_attention(
                meta.block_tables,
                meta.context_lens,
                meta.query_start_loc,
                self.k_cache.shape[1],
                self.k_cache.shape[2],
                meta.max_query_len,
                meta.max_context_len,
            )
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q, k, v: [num_tokens, heads, head_dim] before RoPE; cos_sin: each token's rotation. A step
        with prompt tokens on the GPU keeps its keys and values laid end to end as well (new_kv),
        for the prefill kernel."""
        store = (self.k_cache, self.v_cache, meta.slot_mapping, *self.kv_scales())
        if not use_triton(q) or meta.max_query_len == 1:
            return self.attend(rope_and_store(q, k, v, *cos_sin, *store), meta)
        new_kv = tuple(torch.empty(k.shape, dtype=self.k_cache.dtype, device=k.device) for _ in range(2))
        return self.attend(rope_and_store_triton(q, k, v, *cos_sin, *store, new_kv=new_kv), meta, new_kv)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, new_kv=None) -> torch.Tensor:
        """q: [num_tokens, heads, head_dim], rotated, this step's keys and values in the cache (and
        in new_kv, if given: rope_and_store_triton's). An FP8 cache's k_scale scales the scores
        (with the softmax's scale), its v_scale the output."""
        k_scale, v_scale = self.kv_scales()
        out = self._attend(q, meta, self.scale * k_scale, new_kv)
        return out if v_scale == 1.0 else out.mul_(v_scale)

    def _attend(self, q: torch.Tensor, meta: AttentionMetadata, scale: float, new_kv=None) -> torch.Tensor:
        if not use_triton(q):
            if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and not cpu_gemm(q.dtype):
                # (torch's CPU attention multiplies in the queries' dtype: in fp32, a fifth of the time)
                return paged_attention_ref(q.float(), self.k_cache, self.v_cache, meta.plan, scale).to(q.dtype)
            return paged_attention_ref(q, self.k_cache, self.v_cache, meta.plan, scale)
        if meta.max_query_len == 1:
            return decode_attention_triton(q, self.k_cache, self.v_cache, meta.block_tables, meta.context_lens, scale)
        # A mixed step: sequences with one query (decodes) go to the decode kernel, which reads
        # each KV head once for its whole query group and splits long contexts; the rest to the
        # prefill kernel; both write their rows of one output.
        out = torch.empty_like(q)
        if meta.any_single_query:
            decode_attention_triton(
                q,
                self.k_cache,
                self.v_cache,
                meta.block_tables,
                meta.context_lens,
                scale,
                query_start_loc=meta.query_start_loc,
                out=out,
            )
        return prefill_attention_triton(
            q,
            self.k_cache,
            self.v_cache,
            meta.block_tables,
            meta.context_lens,
            meta.query_start_loc,
            scale,
            meta.max_query_len,
            out=out,
            skip_single=meta.any_single_query,
            work=meta.prefill_work,
            new_kv=new_kv,
        )
