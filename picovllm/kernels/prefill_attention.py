"""Causal GQA prefill attention over the paged cache for a variable-length batch: each sequence's
new queries attend to its whole context (cached prefix blocks included) read through its block
table, which is what prefix caching and chunked prefill need. The reference is
paged_attention_ref (paged_attention.py).

The grid runs over a work list, one item per (sequence, block of BLOCK_M queries), built on the
host (prefill_work) and padded with -1 to a fixed capacity in CUDA graphs. A grid over every
(sequence slot, query block) instead had mostly empty programs in mixed-step graphs (slots of
decodes, which the decode kernel takes, and of padding), and empty programs are not free: tens
of thousands of them per layer cost more than the prefill's work.

Split-K over the keys, for steps with few queries over long contexts (a prompt whose long
prefix is cached, a late chunk of a long prompt): one program per (work item, head) would leave
the GPU nearly idle (a dozen programs for 40 new tokens over 2,083 cached). The number of
splits depends on the step's shape alone (token count, work capacity), never the contexts, so a
CUDA graph serves any context. Each query block cuts its causal key
range into slices of whole key tiles (at least MIN_PART keys); a block whose range fits one
slice writes the output directly, the others write partial softmaxes that a second kernel
merges. Big steps (enough query blocks to fill the GPU) use one split: the plain kernel."""
import numpy as np
import torch

from picovllm.kernels.paged_attention import attend_paged_keys
from picovllm.kernels.triton_utils import dot_precision, next_pow2, pdl, pdl_wait, tl, triton

# Queries per work item (and in CUDA graphs, whose work capacity counts them), 4 warps: the fastest
# of 64 and 128 queries (8 warps) for every case swept, long prompts included
# (benchmarks/kernels/attention_sweep.py).
BLOCK_M = 64
TARGET_PROGRAMS = 256  # about two per SM on a Hopper GPU
MAX_SPLITS = 16
MERGE_ROWS = 8  # query rows per merge program
MAX_PROGRAMS = 12288  # splits only while the grid stays this small (measured: 12k programs for a warm hit)
# Keys per tile: 64, but 32 once a step splits its keys 8 or more ways (few queries over a long
# context): shorter splits (at least 2 tiles each) leave more of them busy (a warm prefix hit and
# a late chunk, benchmarks/kernels/attention_sweep.py).
BLOCK_N, SPLIT_BLOCK_N, SPLIT_BLOCK_N_FROM = 64, 32, 8


def num_splits(num_heads: int, max_query_len: int, block_m: int, work_items: int = 1) -> int:
    """Key splits per work item: a power of two giving about TARGET_PROGRAMS programs for one
    sequence of max_query_len queries, within MAX_PROGRAMS for the grid of work_items items."""
    blocks = num_heads * -(-max_query_len // block_m)
    want = min(MAX_SPLITS, next_pow2(-(-TARGET_PROGRAMS // blocks)))
    room = MAX_PROGRAMS // (num_heads * work_items)
    return max(1, min(want, 1 << max(0, room.bit_length() - 1)))


def _query_blocks(query_lens, block_m: int, include_single: bool) -> tuple[np.ndarray, np.ndarray]:
    """The sequences the prefill kernel takes (at least two queries; or one, with include_single:
    single-query sequences are otherwise the decode kernel's) and their numbers of query blocks."""
    q = np.asarray(query_lens, dtype=np.int64)
    seqs = np.flatnonzero(q >= (1 if include_single else 2))
    return seqs, -(-q[seqs] // block_m)


def num_work_items(query_lens: np.ndarray, block_m: int = BLOCK_M) -> int:
    """Items of prefill_work(query_lens, block_m), without building it."""
    return int(_query_blocks(query_lens, block_m, False)[1].sum())


def prefill_work(query_lens, block_m: int = BLOCK_M, capacity: int | None = None,
                 include_single: bool = False) -> np.ndarray:
    """The work list: b << 16 | query block, for each block of block_m queries of each sequence
    b the kernel takes (_query_blocks), padded with -1 to `capacity`."""
    seqs, blocks = _query_blocks(query_lens, block_m, include_single)
    first = np.repeat(np.cumsum(blocks) - blocks, blocks)  # each item's sequence's first item
    items = (np.repeat(seqs, blocks) << 16) | (np.arange(len(first)) - first)
    if capacity is None:
        return items
    assert len(items) <= capacity, (len(items), capacity)
    return np.concatenate([items, np.full(capacity - len(items), -1, dtype=np.int64)])


@triton.jit
def _query_block(query_start_loc, context_lens, b, mblk, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, MIN_PART: tl.constexpr):
    """Query block mblk of sequence b as both kernels see it: the sequence's first token row, its
    query count, its prefix (the context before its queries: query i sits at position prefix + i),
    the end of the block's causal key range, and the keys per split."""
    q_start = tl.load(query_start_loc + b)
    q_len = tl.load(query_start_loc + b + 1) - q_start
    prefix = tl.load(context_lens + b) - q_len
    end = tl.minimum(prefix + q_len, prefix + (mblk + 1) * BLOCK_M)  # causal: no key after the last query
    part = tl.maximum(tl.cdiv(tl.cdiv(end, SPLITS), BLOCK_N) * BLOCK_N, MIN_PART)
    return q_start, q_len, prefix, end, part


@triton.jit(do_not_specialize=["s_tb"])  # the block-table width changes from step to step
def _prefill_kernel(
    q, k_cache, v_cache, block_tables, context_lens, query_start_loc, work, out, part_acc, part_ml, k_new, v_new,
    s_qt, s_qh, s_qd, c_kb, c_ks, c_kh, c_kd, c_vb, c_vs, c_vh, c_vd, s_tb, s_tw, s_ot, s_oh,
    s_at, s_ah, s_as, s_mt, s_mh, s_nt, s_nh, s_nd,
    scale, group,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr, MIN_PART: tl.constexpr, USE_PDL: tl.constexpr,
    NEW_KV: tl.constexpr,
):
    pdl_wait(USE_PDL)
    item = tl.load(work + tl.program_id(0))
    if item < 0:  # padding
        return
    b = item >> 16
    mblk = item & 0xFFFF
    h = tl.program_id(1)
    split = tl.program_id(2)
    q_start, q_len, prefix, end, part = _query_block(query_start_loc, context_lens, b, mblk, SPLITS, BLOCK_M,
                                                     BLOCK_N, MIN_PART)
    start = split * part
    if start >= end:
        return
    kvh = h // group
    m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    mmask = m < q_len
    dmask = d < HEAD_DIM
    rows = q_start + m
    qv = tl.load(q + rows[:, None] * s_qt + h * s_qh + d[None, :] * s_qd, mask=mmask[:, None] & dmask[None, :],
                 other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # rows whose queries come before `start` see no key here (NaN partials): the merge skips them
    stop = tl.minimum(start + part, end)
    q_pos, q_first, table_row = prefix + m, prefix + mblk * BLOCK_M, block_tables + b * s_tb
    paged_stop = tl.minimum(stop, prefix) if NEW_KV else stop  # (the step's own keys: k_new, v_new)
    m_i, l_i, acc = attend_paged_keys(qv, q_pos, q_first, m_i, l_i, acc, k_cache, v_cache, table_row,
                                      s_tw, kvh, c_kb, c_ks, c_kh, c_kd, c_vb, c_vs, c_vh, c_vd, start,
                                      paged_stop, d, dmask, scale, BLOCK_SIZE=BLOCK_SIZE,
                                      CAUSAL=True, BLOCK_N=BLOCK_N, PRECISION=PRECISION, PAGED=True)
    if NEW_KV:  # key `prefix + i` is row q_start + i of k_new and v_new
        first = q_start - prefix
        m_i, l_i, acc = attend_paged_keys(qv, q_pos, q_first, m_i, l_i, acc, k_new + first * s_nt,
                                          v_new + first * s_nt, table_row, s_tw, kvh, 0, s_nt, s_nh, s_nd, 0, s_nt,
                                          s_nh, s_nd, tl.maximum(start, prefix), stop, d, dmask, scale,
                                          BLOCK_SIZE=BLOCK_SIZE, CAUSAL=True, BLOCK_N=BLOCK_N, PRECISION=PRECISION,
                                          PAGED=False)
    out_mask = mmask[:, None] & dmask[None, :]
    if part >= end:  # the whole range in one split: the output, no partials to merge
        tl.store(out + rows[:, None] * s_ot + h * s_oh + d[None, :], (acc / l_i[:, None]).to(out.dtype.element_ty),
                 mask=out_mask)
    else:
        tl.store(part_acc + rows[:, None] * s_at + h * s_ah + split * s_as + d[None, :], acc, mask=out_mask)
        tl.store(part_ml + rows * s_mt + h * s_mh + 2 * split, m_i, mask=mmask)
        tl.store(part_ml + rows * s_mt + h * s_mh + 2 * split + 1, l_i, mask=mmask)


@triton.jit
def _prefill_merge_kernel(
    context_lens, query_start_loc, work, out, part_acc, part_ml, s_ot, s_oh, s_at, s_ah, s_as, s_mt, s_mh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
    MIN_PART: tl.constexpr, MERGE_ROWS: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    item = tl.load(work + tl.program_id(0))
    if item < 0:
        return
    b = item >> 16
    mblk = item & 0xFFFF
    h = tl.program_id(1)
    r0 = tl.program_id(2) * MERGE_ROWS  # a few rows per program: [SPLITS x BLOCK_M x D] would spill, and a
    q_start, q_len, prefix, end, part = _query_block(query_start_loc, context_lens, b, mblk, SPLITS, BLOCK_M,
                                                     BLOCK_N, MIN_PART)  # loop over row groups serialises loads
    if part >= end or mblk * BLOCK_M + r0 >= q_len:  # written by the partition kernel, or no rows here
        return
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    m = mblk * BLOCK_M + r0 + tl.arange(0, MERGE_ROWS)
    mmask = m < q_len
    rows = q_start + m
    big_m = tl.full([MERGE_ROWS], float("-inf"), tl.float32)
    big_l = tl.zeros([MERGE_ROWS], tl.float32)
    acc = tl.zeros([MERGE_ROWS, BLOCK_D], tl.float32)
    for s in tl.static_range(SPLITS):
        seen = mmask & (s * part <= prefix + m)  # the split holds keys for this row (queries precede `end`)
        m_s = tl.load(part_ml + rows * s_mt + h * s_mh + 2 * s, mask=seen, other=float("-inf"))
        l_s = tl.load(part_ml + rows * s_mt + h * s_mh + 2 * s + 1, mask=seen, other=0.0)
        a_s = tl.load(part_acc + rows[:, None] * s_at + h * s_ah + s * s_as + d[None, :],
                      mask=seen[:, None] & dmask[None, :], other=0.0)
        new_m = tl.maximum(big_m, m_s)
        alpha = tl.where(big_m == float("-inf"), 0.0, tl.math.exp2(big_m - new_m))  # (base 2: attend_paged_keys)
        beta = tl.where(seen, tl.math.exp2(m_s - new_m), 0.0)
        big_l = big_l * alpha + l_s * beta
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        big_m = new_m
    tl.store(out + rows[:, None] * s_ot + h * s_oh + d[None, :], (acc / big_l[:, None]).to(out.dtype.element_ty),
             mask=mmask[:, None] & dmask[None, :])


def prefill_attention_triton(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, context_lens: torch.Tensor,
                             query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                             block_m: int = BLOCK_M, block_n: int | None = None, out: torch.Tensor | None = None,
                             skip_single: bool = False, splits: int | None = None,
                             work: torch.Tensor | None = None, num_warps: int | None = None,
                             num_stages: int = 2,
                             new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim] -> same shape. work: the work list
    (prefill_work(..., block_m), on the device); without it, it is built from query_start_loc
    (a device-to-host copy), leaving out the single-query sequences when skip_single (their rows
    of `out` are the decode kernel's). splits: key splits, a power of two (num_splits() unless
    given). block_n: keys per tile (BLOCK_N, or SPLIT_BLOCK_N from SPLIT_BLOCK_N_FROM splits).
    num_warps (default 8 from 128 queries per item, else 4), num_stages: the partition
    kernel's launch options (2 stages: a little faster than 3 in every case swept). new_kv: this
    step's keys and values as the cache holds them, laid end to end as the queries are
    ([num_tokens, kv_heads, head_dim] each, one layout: rope_and_store's new_kv): each sequence's
    keys of this step are read from them, its cached prefix's through the block table."""
    num_tokens, num_heads, head_dim = query.shape
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if work is None:
        lens = query_start_loc.diff().cpu().numpy()
        work = torch.from_numpy(prefill_work(lens, block_m, include_single=not skip_single)).to(query.device)
    if work.numel() == 0:
        return out
    splits = splits or num_splits(num_heads, max_query_len, block_m, work.numel())
    block_n = block_n or (SPLIT_BLOCK_N if splits >= SPLIT_BLOCK_N_FROM else BLOCK_N)
    if splits > 1:
        part_acc = torch.empty((num_tokens, num_heads, splits, head_dim), dtype=torch.float32, device=query.device)
        part_ml = torch.empty((num_tokens, num_heads, 2 * splits), dtype=torch.float32, device=query.device)
        part_strides = (*part_acc.stride()[:3], *part_ml.stride()[:2])
    else:  # never touched: every query block fits one split
        part_acc = part_ml = out
        part_strides = (0,) * 5
    consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=next_pow2(head_dim), SPLITS=splits, MIN_PART=2 * block_n,
                  **pdl(query))
    k_new, v_new = new_kv if new_kv is not None else (k_cache, v_cache)  # (unread without new_kv)
    assert new_kv is None or k_new.stride() == v_new.stride(), "k_new and v_new: one layout"
    _prefill_kernel[(work.numel(), num_heads, splits)](
        query, k_cache, v_cache, block_tables, context_lens, query_start_loc, work, out, part_acc, part_ml, k_new,
        v_new, *query.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), out.stride(0),
        out.stride(1), *part_strides, *k_new.stride()[-3:], scale,
        num_heads // k_cache.shape[2], BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        PRECISION=dot_precision(query.dtype), num_warps=num_warps or (8 if block_m >= 128 else 4),
        num_stages=num_stages, NEW_KV=new_kv is not None, **consts,
    )
    if splits > 1:
        merge_rows = min(MERGE_ROWS, block_m)
        _prefill_merge_kernel[(work.numel(), num_heads, block_m // merge_rows)](
            context_lens, query_start_loc, work, out, part_acc, part_ml, out.stride(0), out.stride(1), *part_strides,
            HEAD_DIM=head_dim, MERGE_ROWS=merge_rows, **consts,
        )
    return out
