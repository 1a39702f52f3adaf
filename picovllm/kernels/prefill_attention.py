"""Causal GQA prefill attention over the paged cache for a variable-length batch: each sequence's
new queries attend to its whole context (cached prefix blocks included) read through its block
table, which is what prefix caching and chunked prefill need. The reference is
paged_attention_ref (paged_attention.py)."""
import torch

from picovllm.kernels.paged_attention import attend_paged_keys
from picovllm.kernels.triton_utils import dot_precision, next_pow2, tl, triton


@triton.jit(do_not_specialize=["s_tb"])  # the block-table width changes from step to step
def _prefill_kernel(
    q, k_cache, v_cache, block_tables, context_lens, query_start_loc, out,
    s_qt, s_qh, s_qd, c_kb, c_ks, c_kh, c_kd, c_vb, c_vs, c_vh, c_vd, s_tb, s_tw, s_ot, s_oh,
    scale, block_size, head_dim, group,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    SKIP_SINGLE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)
    q_start = tl.load(query_start_loc + b)
    q_len = tl.load(query_start_loc + b + 1) - q_start
    if mblk * BLOCK_M >= q_len:
        return
    if SKIP_SINGLE:  # single-query sequences are the decode kernel's (GQA-grouped, split-K)
        if q_len == 1:
            return
    ctx = tl.load(context_lens + b)
    prefix = ctx - q_len
    kvh = h // group
    m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    mmask = m < q_len
    dmask = d < head_dim
    q_pos = prefix + m
    qv = tl.load(q + (q_start + m)[:, None] * s_qt + h * s_qh + d[None, :] * s_qd,
                 mask=mmask[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = tl.minimum(ctx, prefix + (mblk + 1) * BLOCK_M)  # causal: no key after the last query
    m_i, l_i, acc = attend_paged_keys(qv, q_pos, m_i, l_i, acc, k_cache, v_cache, block_tables + b * s_tb, s_tw, kvh,
                                      c_kb, c_ks, c_kh, c_kd, c_vb, c_vs, c_vh, c_vd, 0, end, block_size, d, dmask,
                                      scale, CAUSAL=True, BLOCK_N=BLOCK_N, PRECISION=PRECISION)
    res = acc / l_i[:, None]
    tl.store(out + (q_start + m)[:, None] * s_ot + h * s_oh + d[None, :], res.to(out.dtype.element_ty),
             mask=mmask[:, None] & dmask[None, :])


def prefill_attention_triton(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, context_lens: torch.Tensor,
                             query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                             block_m: int = 64, block_n: int = 64, out: torch.Tensor | None = None,
                             skip_single: bool = False) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim] -> same shape. skip_single leaves the rows of
    single-query sequences of `out` to the decode kernel."""
    num_tokens, num_heads, head_dim = query.shape
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    batch = block_tables.shape[0]
    _prefill_kernel[(batch, num_heads, triton.cdiv(max_query_len, block_m))](
        query, k_cache, v_cache, block_tables, context_lens, query_start_loc, out,
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), out.stride(0), out.stride(1),
        scale, k_cache.shape[1], head_dim, num_heads // k_cache.shape[2],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=next_pow2(head_dim), PRECISION=dot_precision(query.dtype),
        SKIP_SINGLE=skip_single,
    )
    return out
