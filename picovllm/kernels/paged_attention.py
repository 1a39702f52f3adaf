"""Causal GQA attention of a batch of queries over the paged KV cache (prefill and decode)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from picovllm.kernels.triton_utils import tl, triton


class AttentionGroup(NamedTuple):
    """Sequences the reference attends to together: queries padded to the group's longest, keys
    to its longest context."""

    pieces: torch.Tensor  # [b * kv_heads * blocks]: the cache's (block, head) pieces to read, in order
    max_context: int
    rows: torch.Tensor  # [b, max_q] row of each padded query in the flat token batch
    kept: torch.Tensor  # indices of the real queries in the flattened [b * max_q] output
    tokens: torch.Tensor  # their rows in the flat token batch (rows.flatten()[kept])
    mask: torch.Tensor | None  # [b, 1, max_q, max_context] True where a query may attend to a key;
    # None: one prompt and no cached prefix, plain causal attention (is_causal skips the masked half)


class AttentionPlan(NamedTuple):
    """What the reference attention derives from the batch layout; the same for every layer, so
    it is built once per forward (plan_paged_attention) and reused by all layers. A mixed step's
    sequences of one query (decodes) and of several (prompts) are two groups: padded together,
    every decode would compute as many queries as the longest prompt chunk."""

    groups: tuple[AttentionGroup, ...]


def _plan_group(tables: torch.Tensor, context_lens: torch.Tensor, starts: torch.Tensor, q_lens: torch.Tensor,
                block_size: int, num_kv_heads: int, max_q: int, max_ctx: int) -> AttentionGroup:
    device = tables.device
    q_idx = torch.arange(max_q, device=device)
    q_valid = q_idx[None, :] < q_lens[:, None]
    rows = torch.where(q_valid, starts[:, None] + q_idx, 0)
    kept = q_valid.flatten().nonzero().squeeze(1)
    blocks = tables[:, None, : -(-max_ctx // block_size)].long()
    pieces = (blocks * num_kv_heads + torch.arange(num_kv_heads, device=device)[:, None]).flatten()
    # (max_q and max_ctx are bounds: causal only if they are this prompt's length, and it has no prefix)
    if tables.shape[0] == 1 and max_q > 1 and int(q_lens[0]) == int(context_lens[0]) == max_q == max_ctx:
        mask = None
    else:
        q_pos = (context_lens - q_lens)[:, None] + q_idx
        k_pos = torch.arange(max_ctx, device=device)
        mask = ((k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos < context_lens[:, None])[:, None, :])[:, None]
    return AttentionGroup(pieces, max_ctx, rows, kept, rows.flatten()[kept], mask)


def plan_paged_attention(block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                         block_size: int, num_kv_heads: int, max_query_len: int,
                         max_context_len: int) -> AttentionPlan:
    """Query i of a sequence with q_len queries sits at position context_lens[b] - q_len + i and
    attends to keys at positions <= its own; within a group queries are padded to the longest
    query, keys to the longest context, and both paddings are masked out."""
    starts, q_lens = query_start_loc[:-1], query_start_loc[1:] - query_start_loc[:-1]
    geometry = (block_size, num_kv_heads)
    single = q_lens == 1
    if max_query_len == 1 or not bool(single.any()):
        return AttentionPlan((_plan_group(block_tables, context_lens, starts, q_lens, *geometry, max_query_len,
                                          max_context_len),))
    groups = []
    for seqs, max_q in ((single.nonzero().squeeze(1), 1), ((~single).nonzero().squeeze(1), max_query_len)):
        ctx = context_lens[seqs]
        groups.append(_plan_group(block_tables[seqs], ctx, starts[seqs], q_lens[seqs], *geometry, max_q,
                                  int(ctx.max())))
    return AttentionPlan(tuple(groups))


def paged_attention_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        plan: AttentionPlan, scale: float) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim], the tokens of B sequences laid end to end (then
    padding tokens of no sequence, if any: their rows are zeros); caches: [num_blocks, block_size,
    num_kv_heads, head_dim] with this step's K/V already stored. Returns [num_tokens, num_heads,
    head_dim]. The keys and values are read a whole (block, head) piece at a time, as the pool
    lays them out (model_runner.allocate_kv_pool: a block's tokens of one head together), straight
    into the [b, kv_heads, context, head_dim] the attention takes: one copy of each."""
    out = torch.zeros_like(query)
    for g in plan.groups:
        b, (_, _, kv_heads, dim) = g.rows.shape[0], k_cache.shape
        keys, values = (  # (an FP8 cache's upcast to the queries' dtype)
            cache.transpose(1, 2).flatten(0, 1).index_select(0, g.pieces).view(b, kv_heads, -1, dim)
            [:, :, : g.max_context].to(query.dtype) for cache in (k_cache, v_cache))
        q = query[g.rows]  # [b, max_q, H, D]
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=g.mask, scale=scale,
                                                  is_causal=g.mask is None, enable_gqa=True)
        out[g.tokens] = attended.transpose(1, 2).flatten(0, 1)[g.kept]
    return out


@triton.jit
def _attend_tile(qv, q_pos, m_i, l_i, acc, k_cache, v_cache, table_row, s_tw, kvh,
                 c_kb, c_ks, c_kh, c_kd, c_vb, c_vs, c_vh, c_vd, n0, end, d, dmask, scale,
                 BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                 PRECISION: tl.constexpr, PAGED: tl.constexpr):
    """One key tile [n0, n0 + BLOCK_N) of attend_paged_keys; MASKED: keys past `end` (and with
    CAUSAL, keys after a query) are masked out; without it every key of the tile is read and seen."""
    n = n0 + tl.arange(0, BLOCK_N)
    nmask = n < end
    if MASKED:
        kvmask = nmask[:, None] & dmask[None, :]
    else:
        kvmask = dmask[None, :]
    if PAGED:
        if MASKED:
            blk = tl.load(table_row + (n // BLOCK_SIZE) * s_tw, mask=nmask, other=0).to(tl.int64)
        else:
            blk = tl.load(table_row + (n // BLOCK_SIZE) * s_tw).to(tl.int64)
        off = n % BLOCK_SIZE
        k_rows = blk[:, None] * c_kb + off[:, None] * c_ks
        v_rows = blk[:, None] * c_vb + off[:, None] * c_vs
    else:  # keys laid end to end: key n at row n (c_ks, c_vs: the rows' strides)
        k_rows = n[:, None] * c_ks
        v_rows = n[:, None] * c_vs
    kt = tl.load(k_cache + k_rows + kvh * c_kh + d[None, :] * c_kd,
                 mask=kvmask, other=0.0).to(qv.dtype)  # (an FP8 cache's keys in the queries' dtype)
    s = tl.dot(qv, tl.trans(kt), input_precision=PRECISION).to(tl.float32) * (scale * 1.4426950408889634)  # log2(e)
    if MASKED:
        valid = nmask[None, :]
        if CAUSAL:
            valid = valid & (n[None, :] <= q_pos[:, None])
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    vt = tl.load(v_cache + v_rows + kvh * c_vh + d[None, :] * c_vd, mask=kvmask, other=0.0).to(qv.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION).to(tl.float32)
    return m_new, l_i, acc


@triton.jit
def attend_paged_keys(qv, q_pos, q_first, m_i, l_i, acc, k_cache, v_cache, table_row, s_tw, kvh,
                      c_kb, c_ks, c_kh, c_kd, c_vb, c_vs, c_vh, c_vd,
                      start, end, d, dmask, scale,
                      BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                      PAGED: tl.constexpr):
    """The Triton kernels' shared inner loop: queries qv [M, D] attend to the keys at positions
    [start, end) of one sequence, read BLOCK_N at a time through its block table row, updating
    the online softmax (running max m_i, sum l_i, unnormalised acc) in base 2: m_i is the largest
    score times log2(e), and the weights are 2 ** (score * log2(e) - m_i) (exp2, one instruction
    on the GPU, where tl.exp is several: a 2,048-token prompt's attention 80 -> 59 us a layer,
    benchmarks/kernels/attention_sweep.py); the merges of split partials combine them so. CAUSAL
    masks keys after each query's position q_pos (q_first: the smallest of them). Without PAGED
    the keys are laid end to end instead (key n at row n of k_cache and v_cache, strides c_ks and
    c_vs; no table): the prefill kernel's view of a step's own keys, faster to read than through a
    block table (a 2,048-token prompt's attention 107 -> 85 us a layer, attention_sweep.py).

    The tiles that lie wholly before `end` and, with CAUSAL, before every query's position go
    first and unmasked; the rest (the context's last tile, the causal diagonal) masked. BLOCK_SIZE
    (the cache's tokens per block) is a compile-time constant: with a runtime one, `n //
    block_size` and `n % block_size` were 64-bit divisions, eleven per key tile in the prefill
    kernel's loop."""
    clear = tl.minimum(end, q_first + 1) if CAUSAL else end  # keys before it: seen by every query
    full = start + tl.maximum(clear - start, 0) // BLOCK_N * BLOCK_N
    for n0 in range(start, full, BLOCK_N):
        m_i, l_i, acc = _attend_tile(qv, q_pos, m_i, l_i, acc, k_cache, v_cache, table_row, s_tw, kvh,
                                     c_kb, c_ks, c_kh, c_kd, c_vb, c_vs, c_vh, c_vd, n0, end, d, dmask, scale,
                                     BLOCK_SIZE, False, CAUSAL, BLOCK_N, PRECISION, PAGED)
    for n0 in range(full, end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(qv, q_pos, m_i, l_i, acc, k_cache, v_cache, table_row, s_tw, kvh,
                                     c_kb, c_ks, c_kh, c_kd, c_vb, c_vs, c_vh, c_vd, n0, end, d, dmask, scale,
                                     BLOCK_SIZE, True, CAUSAL, BLOCK_N, PRECISION, PAGED)
    return m_i, l_i, acc
