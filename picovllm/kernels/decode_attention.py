"""Paged decode attention with GQA and split-K over the context (flash-decoding): one query per
sequence; each (sequence, KV head, split) program attends one slice of the context for all the
query heads of the group, and a second kernel merges the splits' partial softmaxes (with a single
split, at large batch, the first kernel writes the output and the second is not launched).

The number of splits depends on the batch size alone (enough programs to fill the GPU), never on
the contexts, so a CUDA graph captured for a batch size serves any context: each sequence cuts its
own context into that many slices (rounded up to whole key tiles), and splits past its context
exit at once. The reference is paged_attention_ref (paged_attention.py), which serves decode as a
q_len=1 case."""
import torch

from picovllm.kernels.paged_attention import attend_paged_keys
from picovllm.kernels.triton_utils import dot_precision, next_pow2, pdl, pdl_wait, tl, triton

BLOCK_N = 32  # keys per inner-loop tile
NUM_WARPS, NUM_STAGES = 4, 3  # the partition kernel's launch
# about four programs per SM on a Hopper GPU (at batch 128: 2 splits, not 1)
TARGET_PROGRAMS = 512
MAX_SPLITS = 32
# Mixed steps: the grid covers every sequence slot (in a graph, up to max_num_seqs), whatever
# number of them decode, so the batch size says nothing (num_splits(256 slots) = 1 would leave each
# decode's hundreds of keys to one program). Slots that do not decode exit.
MIXED_SPLITS = 8
# ... and each split at least this many keys: the fastest of the sizes swept
# (benchmarks/kernels/attention_sweep.py decode; figures in benchmarks/README.md).
MIXED_MIN_KEYS = 128


def num_splits(batch: int, num_kv_heads: int) -> int:
    """Splits per (sequence, KV head): a power of two giving about TARGET_PROGRAMS programs."""
    want = -(-TARGET_PROGRAMS // (batch * num_kv_heads))
    return min(MAX_SPLITS, next_pow2(want))


@triton.jit
def _sequence(query_start_loc, context_lens, b, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_PART: tl.constexpr,
              MIXED: tl.constexpr):
    """Sequence b as both kernels see it: the token row of its query; whether it has exactly one
    query (always so in a decode batch; in a mixed batch, the sequences with more belong to the
    prefill kernel); its context length; and the keys per split (a whole number of key tiles, at
    least MIN_PART: the splits past the context exit)."""
    if MIXED:
        row = tl.load(query_start_loc + b)
        single = tl.load(query_start_loc + b + 1) - row == 1
    else:
        row = b
        single = True
    ctx = tl.load(context_lens + b)
    part = tl.maximum(tl.cdiv(tl.cdiv(ctx, SPLITS), BLOCK_N) * BLOCK_N, MIN_PART)
    return row, single, ctx, part


@triton.jit(do_not_specialize=["s_tb"])  # the block-table width changes from step to step
def _decode_partition_kernel(
    q, k_cache, v_cache, block_tables, context_lens, query_start_loc, part_acc, part_m, part_l, out,
    s_qb, s_qh, s_qd, c_kb, c_ks, c_kh, c_kd, c_vb, c_vs, c_vh, c_vd, s_tb, s_tw,
    s_ab, s_ah, s_as, s_mb, s_mh, s_ob, s_oh,
    scale, group,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, MIN_PART: tl.constexpr,
    PRECISION: tl.constexpr, MIXED: tl.constexpr, USE_PDL: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # the step's metadata before the wait: no kernel writes it (the cache and q: after)
    row, single, ctx, part = _sequence(query_start_loc, context_lens, b, SPLITS, BLOCK_N, MIN_PART, MIXED)
    if not single:
        return
    start = split * part
    if start >= ctx:
        return
    pdl_wait(USE_PDL)
    end = tl.minimum(start + part, ctx)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * group + g
    gmask = g < group
    dmask = d < HEAD_DIM
    qv = tl.load(q + row * s_qb + heads[:, None] * s_qh + d[None, :] * s_qd,
                 mask=gmask[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    m_i, l_i, acc = attend_paged_keys(qv, m_i, start, m_i, l_i, acc, k_cache, v_cache, block_tables + b * s_tb,
                                      s_tw, kvh, c_kb, c_ks, c_kh, c_kd, c_vb, c_vs, c_vh, c_vd, start, end, d,
                                      dmask, scale, BLOCK_SIZE=BLOCK_SIZE, CAUSAL=False, BLOCK_N=BLOCK_N,
                                      PRECISION=PRECISION, PAGED=True)
    out_mask = gmask[:, None] & dmask[None, :]
    if SPLITS == 1:  # the whole context in one program: the output, no partials to merge
        tl.store(out + row * s_ob + heads[:, None] * s_oh + d[None, :], (acc / l_i[:, None]).to(out.dtype.element_ty),
                 mask=out_mask)
    else:
        tl.store(part_acc + b * s_ab + heads[:, None] * s_ah + split * s_as + d[None, :], acc, mask=out_mask)
        tl.store(part_m + b * s_mb + heads * s_mh + split, m_i, mask=gmask)
        tl.store(part_l + b * s_mb + heads * s_mh + split, l_i, mask=gmask)


@triton.jit
def _decode_merge_kernel(part_acc, part_m, part_l, context_lens, query_start_loc, out,
                         s_ab, s_ah, s_as, s_mb, s_mh, s_ob, s_oh,
                         HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         MIN_PART: tl.constexpr, MIXED: tl.constexpr, USE_PDL: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row, single, ctx, part = _sequence(query_start_loc, context_lens, b, SPLITS, BLOCK_N, MIN_PART, MIXED)
    if not single:
        return
    pdl_wait(USE_PDL)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, BLOCK_D)
    smask = s * part < ctx
    m = tl.load(part_m + b * s_mb + h * s_mh + s, mask=smask, other=float("-inf"))
    l = tl.load(part_l + b * s_mb + h * s_mh + s, mask=smask, other=0.0)  # noqa: E741 (the softmax's m and l)
    w = tl.where(smask, tl.math.exp2(m - tl.max(m, axis=0)), 0.0)  # (base 2: attend_paged_keys)
    acc = tl.load(part_acc + b * s_ab + h * s_ah + s[:, None] * s_as + d[None, :],
                  mask=smask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    res = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out + row * s_ob + h * s_oh + d, res.to(out.dtype.element_ty), mask=d < HEAD_DIM)


def decode_attention_triton(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            splits: int | None = None, query_start_loc: torch.Tensor | None = None,
                            out: torch.Tensor | None = None, min_keys: int | None = None,
                            block_n: int = BLOCK_N, num_warps: int = NUM_WARPS,
                            num_stages: int = NUM_STAGES) -> torch.Tensor:
    """query: [B, num_heads, head_dim] (one token per sequence) -> [B, num_heads, head_dim].
    splits: per (sequence, KV head), a power of two; unless given, num_splits(B, kv_heads), and at
    least MIXED_SPLITS in a mixed batch. min_keys: the fewest keys per split (rounded up to whole
    key tiles; by default one tile, MIXED_MIN_KEYS in a mixed batch). block_n, num_warps,
    num_stages: the partition kernel's key tile and launch (benchmarks/kernels/attention_sweep.py
    sweeps them).

    Mixed batch (query_start_loc given): query holds the tokens of B sequences end to end; only
    the sequences with exactly one query are attended, into their rows of `out` (the prefill
    kernel fills the others)."""
    batch = block_tables.shape[0]
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    mixed = query_start_loc is not None
    max_splits = splits or max(MIXED_SPLITS if mixed else 1, num_splits(batch, num_kv_heads))
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    # one split writes the output itself; more write partial softmaxes that a second kernel merges
    if max_splits > 1:
        part_acc = torch.empty((batch, num_heads, max_splits, head_dim), dtype=torch.float32, device=query.device)
        part_m = torch.empty((batch, num_heads, max_splits), dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_strides = (*part_acc.stride()[:3], *part_m.stride()[:2])
    else:  # never touched: the kernel's partial stores are compiled out
        part_acc = part_m = part_l = out
        part_strides = (0,) * 5
    qsl = query_start_loc if mixed else context_lens  # (unread when not mixed)
    block_d = next_pow2(head_dim)
    min_part = -(-(min_keys or (MIXED_MIN_KEYS if mixed else block_n)) // block_n) * block_n
    _decode_partition_kernel[(batch, num_kv_heads, max_splits)](
        query, k_cache, v_cache, block_tables, context_lens, qsl, part_acc, part_m, part_l, out,
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        *part_strides, out.stride(0), out.stride(1),
        scale, group, BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        SPLITS=max_splits, BLOCK_N=block_n, BLOCK_G=max(16, next_pow2(group)), BLOCK_D=block_d, MIN_PART=min_part,
        PRECISION=dot_precision(query.dtype), MIXED=mixed, num_warps=num_warps, num_stages=num_stages, **pdl(query),
    )
    if max_splits > 1:
        _decode_merge_kernel[(batch, num_heads)](
            part_acc, part_m, part_l, context_lens, qsl, out, *part_strides, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, SPLITS=max_splits, BLOCK_N=block_n, BLOCK_D=block_d, MIN_PART=min_part, MIXED=mixed,
            **pdl(query),
        )
    return out
