"""Linear layers for a few rows (decode at small batch) as one GEMV kernel that streams the
weight once, with the layer's neighbours fused in:

    out = residual + act(rmsnorm(x) @ weight.T + bias)

- RMSNorm of the input in the prologue: every program reads the whole (small) input anyway, so
  it computes the row's rms itself and no separate norm kernel or normed copy is needed;
- bias in the epilogue; SiLU*mul of a fused gate_up in the epilogue (each program reads the
  gate rows and the matching up rows, so the [M, 2I] intermediate never exists);
- the residual add in the epilogue.

Rounding follows the unfused reference step by step (fused_linear_ref): the normed input is
rounded to the model dtype, as are the linear output, the SiLU output and the residual sum.
The products are reduced on CUDA cores: at one row this beats cuBLAS plus the separate norm /
activation / add kernels on every projection measured, so the model uses it for one row
(model/layers/linear.py); at eight rows cuBLAS's tensor cores win.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from picovllm.kernels.fp8_gemm import fp8_gemm_ref, fp8_row_scale, per_token_fp8_ref, to_fp8
from picovllm.kernels.kv_store import cache_value, rope_and_store_ref, rotate_pair
from picovllm.kernels.rms_norm import rms_norm_ref
from picovllm.kernels.silu_mul import silu_mul_ref, silu_mul_values
from picovllm.kernels.triton_utils import next_pow2, pdl, pdl_wait, tl, triton

MAX_ROWS = 16  # rows in one program (registers); the model uses one


def fused_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                     residual: torch.Tensor | None = None, silu_mul: bool = False,
                     weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """What gemv_triton computes, op by op. weight: [N, K], or [2I, K] for silu_mul (gate rows,
    then up rows); with weight_scale, an FP8 weight and its scale per row (model/layers/fp8.py),
    the (normed) input quantized per row as kernels/fp8_gemm.py quantizes it."""
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps)
    if weight_scale is not None:
        y = fp8_gemm_ref(*per_token_fp8_ref(x), weight, weight_scale, bias, None, x.dtype)
    else:
        y = F.linear(x, weight, bias)
    if silu_mul:
        y = silu_mul_ref(y)
    return y if residual is None else residual + y


@triton.jit
def _normed(xv, rstd, norm_weight, k, kmask, dt):
    """RMSNorm of an input tile, rounded as rms_norm_ref rounds: x * rstd, then * weight."""
    g = tl.load(norm_weight + k, mask=kmask, other=0.0).to(tl.float32)
    xv = (xv * rstd[:, None]).to(dt).to(tl.float32)
    return (g[None, :] * xv).to(dt).to(tl.float32)


@triton.jit
def _input_tile(x, m, mmask, k, K, s_xm, s_xk, rstd, norm_weight, dt, HAS_NORM: tl.constexpr):
    """Columns k of the input rows m in fp32 (past K: zeros), with HAS_NORM normed by the rows'
    1 / rms rstd."""
    kmask = k < K
    xv = tl.load(x + m[:, None] * s_xm + k[None, :] * s_xk, mask=mmask[:, None] & kmask[None, :],
                 other=0.0).to(tl.float32)
    if HAS_NORM:
        xv = _normed(xv, rstd, norm_weight, k, kmask, dt)
    return xv


@triton.jit
def _weight_tiles(weight, rows, rows2, k, nmask, K, s_wn, s_wk, TWO: tl.constexpr):
    """Weight rows `rows` over columns k (past K: masked, nothing read), and with TWO rows `rows2`
    too (the up rows of a fused gate_up, the second halves of RoPE's pairs; without it, the second
    tile is the first: unused)."""
    wmask = nmask[:, None] & (k[None, :] < K)
    w = tl.load(weight + rows[:, None] * s_wn + k[None, :] * s_wk, mask=wmask, other=0.0)
    w2 = w
    if TWO:
        w2 = tl.load(weight + rows2[:, None] * s_wn + k[None, :] * s_wk, mask=wmask, other=0.0)
    return w, w2


@triton.jit
def _rows_times_tile(xv, w):
    """[M, K] rows times an [N, K] weight tile, transposed: [M, N] in fp32, reduced on CUDA cores."""
    return tl.sum(xv[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _products(x, weight, norm_weight, m, mmask, rows, rows2, nmask, K, s_xm, s_xk, s_wn, s_wk, eps, dt,
              HAS_NORM: tl.constexpr, TWO: tl.constexpr, FP8_X: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr, USE_PDL: tl.constexpr):
    """rmsnorm(x[m]) (or x[m]) times weight rows `rows`, and with TWO rows `rows2`: two [BLOCK_M,
    BLOCK_N] fp32 tiles, and the input rows' scales. With FP8_X the input rows are quantized to
    e4m3 per row first (kernels/fp8_gemm.py's rounding; the sums are then to be scaled by the
    rows' scales), else their scales are ones. The kernel's wait for the previous one (PDL) is in
    here, after the first weight loads."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    x_scale = tl.full([BLOCK_M], 1.0, tl.float32)
    if ONE_TILE:  # K <= BLOCK_K: weight loads are issued first, their latency hides the norm's
        k = tl.arange(0, BLOCK_K)
        kmask = k < K
        w, w2 = _weight_tiles(weight, rows, rows2, k, nmask, K, s_wn, s_wk, TWO)
        pdl_wait(USE_PDL)  # (with PDL the weight loads also overlap the previous kernel)
        xv = tl.load(x + m[:, None] * s_xm + k[None, :] * s_xk, mask=mmask[:, None] & kmask[None, :],
                     other=0.0).to(tl.float32)
        if HAS_NORM:
            rstd = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=1) / K + eps)
            xv = _normed(xv, rstd, norm_weight, k, kmask, dt)
        if FP8_X:
            x_scale = fp8_row_scale(tl.max(tl.abs(xv), axis=1))
            xv = to_fp8(xv, 1.0 / x_scale[:, None]).to(tl.float32)
        acc += _rows_times_tile(xv, w)
        if TWO:
            acc2 += _rows_times_tile(xv, w2)
    else:
        # the first weight tile's loads before the wait (ONE_TILE issues all of them there), each
        # next tile's after the current one's products
        w, w2 = _weight_tiles(weight, rows, rows2, tl.arange(0, BLOCK_K), nmask, K, s_wn, s_wk, TWO)
        pdl_wait(USE_PDL)
        rstd = tl.full([BLOCK_M], 1.0, tl.float32)
        if HAS_NORM:  # each row's 1 / rms, from a first pass over the (cached) input
            sq = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                xv = _input_tile(x, m, mmask, k0 + tl.arange(0, BLOCK_K), K, s_xm, s_xk, rstd, norm_weight, dt, False)
                sq += xv * xv
            rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=1) / K + eps)
        if FP8_X:  # each row's scale, from a pass over the (normed) input
            amax = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                xv = _input_tile(x, m, mmask, k0 + tl.arange(0, BLOCK_K), K, s_xm, s_xk, rstd, norm_weight, dt,
                                 HAS_NORM)
                amax = tl.maximum(amax, tl.abs(xv))
            x_scale = fp8_row_scale(tl.max(amax, axis=1))
        x_inv = 1.0 / x_scale
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xv = _input_tile(x, m, mmask, k, K, s_xm, s_xk, rstd, norm_weight, dt, HAS_NORM)
            if FP8_X:
                xv = to_fp8(xv, x_inv[:, None]).to(tl.float32)
            acc += _rows_times_tile(xv, w)
            if TWO:
                acc2 += _rows_times_tile(xv, w2)
            w, w2 = _weight_tiles(weight, rows, rows2, k + BLOCK_K, nmask, K, s_wn, s_wk, TWO)  # the next
    return acc, acc2, x_scale


@triton.jit
def _row_scales(weight_scale, rows, rows2, nmask, HAS_SCALE: tl.constexpr, TWO: tl.constexpr, BLOCK_N: tl.constexpr):
    """An FP8 weight's scales of rows `rows` (and with TWO of `rows2`); ones without HAS_SCALE."""
    scale = tl.full([BLOCK_N], 1.0, tl.float32)
    scale2 = tl.full([BLOCK_N], 1.0, tl.float32)
    if HAS_SCALE:
        scale = tl.load(weight_scale + rows, mask=nmask, other=1.0)
        if TWO:
            scale2 = tl.load(weight_scale + rows2, mask=nmask, other=1.0)
    return scale, scale2


@triton.jit
def _gemv_kernel(
    x, weight, weight_scale, bias, norm_weight, residual, out,
    M, N, K, s_xm, s_xk, s_wn, s_wk, s_rm, s_om, up_offset, eps,
    HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr,
    HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ONE_TILE: tl.constexpr, USE_PDL: tl.constexpr,
):
    dt = out.dtype.element_ty
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    nmask = n < N
    mmask = m < M
    scale, scale_up = _row_scales(weight_scale, n, n + up_offset, nmask, HAS_SCALE, SILU_MUL, BLOCK_N)
    acc, acc_up, x_scale = _products(x, weight, norm_weight, m, mmask, n, n + up_offset, nmask, K, s_xm, s_xk, s_wn,
                                     s_wk, eps, dt, HAS_NORM, SILU_MUL, HAS_SCALE, BLOCK_M, BLOCK_N, BLOCK_K, ONE_TILE,
                                     USE_PDL)
    if HAS_SCALE:
        acc *= x_scale[:, None] * scale[None, :]
        acc_up *= x_scale[:, None] * scale_up[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    y = acc.to(dt)
    if SILU_MUL:
        y = silu_mul_values(y.to(tl.float32), acc_up.to(dt).to(tl.float32), dt)
    omask = mmask[:, None] & nmask[None, :]
    if HAS_RESIDUAL:
        res = tl.load(residual + m[:, None] * s_rm + n[None, :], mask=omask, other=0.0)
        y = (y.to(tl.float32) + res.to(tl.float32)).to(dt)
    tl.store(out + m[:, None] * s_om + n[None, :], y, mask=omask)


def gemv_config(rows: int, n: int, k: int, norm: bool = False, silu_mul: bool = False, fp8: bool = False) -> dict:
    """Tiles and warps for `rows` rows of an [n, k] weight (n outputs: with silu_mul each program
    reads 2 weight rows per output); norm: the RMSNorm is fused in; fp8: the weight in e4m3. Swept
    on a Hopper GPU at one row as the model runs them, a whole step's GEMVs graphed under
    programmatic dependent launch (benchmarks/kernels/gemv_sweep.py chain [fp8]). K in one tile (up
    to 2,048): with the norm fused, 4 weight rows per program on one warp (both reductions stay
    within the warp: no shared memory, no barrier); without (the o projection), 8 rows on 2 warps.
    Deeper K (the down projection): 4,096-wide tiles of 4 rows on 8 warps. FP8 weights: fewer rows
    a warp (a fused gate_up's 8 on 2 warps, the o projection's 4 on 4, the down projection's 2 in
    2,048-wide tiles on 4)."""
    block_m = next_pow2(rows)
    if fp8:
        if k > 2048:
            return dict(BLOCK_M=block_m, BLOCK_N=2, BLOCK_K=2048, num_warps=4)
        if norm:
            return dict(BLOCK_M=block_m, BLOCK_N=4 if silu_mul else 2, BLOCK_K=max(16, next_pow2(k)),
                        num_warps=2 if silu_mul else 1)
        return dict(BLOCK_M=block_m, BLOCK_N=4, BLOCK_K=max(16, next_pow2(k)), num_warps=4)
    if k > 2048:
        return dict(BLOCK_M=block_m, BLOCK_N=4, BLOCK_K=4096, num_warps=8)
    if norm:
        return dict(BLOCK_M=block_m, BLOCK_N=2 if silu_mul else 4, BLOCK_K=max(16, next_pow2(k)), num_warps=1)
    return dict(BLOCK_M=block_m, BLOCK_N=8, BLOCK_K=max(16, next_pow2(k)), num_warps=2)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                residual: torch.Tensor | None = None, silu_mul: bool = False,
                weight_scale: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    rows, k = x.shape
    assert rows <= MAX_ROWS, f"gemv serves at most {MAX_ROWS} rows, got {rows}"
    assert not (silu_mul and bias is not None), "a fused gate_up has no bias"
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    cfg = {"num_warps": 4, **(config or gemv_config(rows, n, k, norm_weight is not None, silu_mul,
                                                    weight_scale is not None))}
    res = residual if residual is not None else out
    _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, weight, weight_scale if weight_scale is not None else x, bias if bias is not None else x,
        norm_weight if norm_weight is not None else x, res, out, rows, n, k, x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1), res.stride(0), out.stride(0), n, eps,
        HAS_BIAS=bias is not None, HAS_NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None,
        SILU_MUL=silu_mul, HAS_SCALE=weight_scale is not None, ONE_TILE=k <= cfg["BLOCK_K"], **cfg, **pdl(x),
    )
    return out


def qkv_rope_store_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor,
                       eps: float, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                       weight_scale: torch.Tensor | None = None, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> torch.Tensor:
    """What qkv_rope_store_triton computes, op by op: the fused QKV projection of the normed input,
    then RoPE on the queries and keys, the keys and values stored (kernels/kv_store.py); returns the
    rotated queries, [rows, num_heads, head_dim]."""
    rows, head_dim = x.shape[0], cos.shape[-1] * 2
    qkv = fused_linear_ref(x, weight, bias, norm_weight, eps, weight_scale=weight_scale)
    q, k, v = qkv.view(rows, num_heads + 2 * num_kv_heads, head_dim).split([num_heads, num_kv_heads, num_kv_heads], 1)
    return rope_and_store_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@triton.jit
def _qkv_rope_store_kernel(
    x, weight, weight_scale, bias, norm_weight, cos, sin, slot_mapping, q_out, k_cache, v_cache,
    M, K, s_xm, s_xk, s_wn, s_wk, s_cm, s_qm, s_qh,
    c_kb, c_ks, c_kh, c_kd, c_vb, c_vs, c_vh, c_vd, eps, num_heads, num_kv_heads, k_inv, v_inv,
    HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Each program computes BLOCK_N of RoPE's pairs, the output rows (d, d + HALF) of one head, over
    the query, key and value heads end to end: the pair is rotated in registers (values are not),
    queries go to q_out, keys and values to their cache slots."""
    dt = q_out.dtype.element_ty
    j = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    head = j // HALF
    i = j % HALF
    first = head * (2 * HALF) + i  # the pair's weight rows: first and first + HALF
    nmask = head < num_heads + 2 * num_kv_heads
    m = tl.arange(0, BLOCK_M)
    mmask = m < M
    # the epilogue's inputs before the products (and their wait): weights and the step's metadata
    cmask = mmask[:, None] & nmask[None, :]
    c = tl.load(cos + m[:, None] * s_cm + i[None, :], mask=cmask, other=0.0).to(tl.float32)
    s = tl.load(sin + m[:, None] * s_cm + i[None, :], mask=cmask, other=0.0).to(tl.float32)
    slot = tl.load(slot_mapping + m, mask=mmask, other=-1).to(tl.int64)
    b1 = tl.zeros([BLOCK_N], tl.float32)
    b2 = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        b1 = tl.load(bias + first, mask=nmask, other=0.0).to(tl.float32)
        b2 = tl.load(bias + first + HALF, mask=nmask, other=0.0).to(tl.float32)
    scale1, scale2 = _row_scales(weight_scale, first, first + HALF, nmask, HAS_SCALE, True, BLOCK_N)
    acc1, acc2, x_scale = _products(x, weight, norm_weight, m, mmask, first, first + HALF, nmask, K, s_xm, s_xk, s_wn,
                                    s_wk, eps, dt, True, True, HAS_SCALE, BLOCK_M, BLOCK_N, BLOCK_K, ONE_TILE, USE_PDL)
    if HAS_SCALE:
        acc1 *= x_scale[:, None] * scale1[None, :]
        acc2 *= x_scale[:, None] * scale2[None, :]
    acc1 += b1[None, :]
    acc2 += b2[None, :]
    y1 = acc1.to(dt).to(tl.float32)  # (the projection's output, rounded as the reference's)
    y2 = acc2.to(dt).to(tl.float32)
    r1, r2 = rotate_pair(y1, y2, c, s, dt)
    rotated = (head < num_heads + num_kv_heads)[None, :]  # (values are not rotated)
    o1 = tl.where(rotated, r1, y1.to(dt))
    o2 = tl.where(rotated, r2, y2.to(dt))
    qmask = cmask & (head < num_heads)[None, :]
    qdst = q_out + m[:, None] * s_qm + head[None, :] * s_qh + i[None, :]
    tl.store(qdst, o1, mask=qmask)
    tl.store(qdst + HALF, o2, mask=qmask)
    blk = (slot // BLOCK_SIZE)[:, None]  # (a constexpr: no 64-bit division)
    off = (slot % BLOCK_SIZE)[:, None]
    stored = cmask & (slot >= 0)[:, None]
    kh = (head - num_heads)[None, :]
    kmask = stored & (kh >= 0) & (kh < num_kv_heads)
    kdst = k_cache + blk * c_kb + off * c_ks + kh * c_kh + i[None, :] * c_kd
    tl.store(kdst, cache_value(o1, k_cache, k_inv), mask=kmask)
    tl.store(kdst + HALF * c_kd, cache_value(o2, k_cache, k_inv), mask=kmask)
    vh = kh - num_kv_heads
    vmask = stored & (vh >= 0)
    vdst = v_cache + blk * c_vb + off * c_vs + vh * c_vh + i[None, :] * c_vd
    tl.store(vdst, cache_value(o1, v_cache, v_inv), mask=vmask)
    tl.store(vdst + HALF * c_vd, cache_value(o2, v_cache, v_inv), mask=vmask)


def qkv_rope_store_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor,
                          eps: float, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                          weight_scale: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                          config: dict | None = None) -> torch.Tensor:
    """The QKV projection of rmsnorm(x) with RoPE and the KV store in its epilogue (a layer's first
    three ops at decode batch 1 in one kernel); returns the rotated queries, [rows, num_heads,
    head_dim]. weight: [(num_heads + 2 * num_kv_heads) * head_dim, K], rows as QKVParallelLinear
    holds them."""
    rows, k = x.shape
    assert rows <= MAX_ROWS, f"gemv serves at most {MAX_ROWS} rows, got {rows}"
    half = cos.shape[-1]
    pairs = weight.shape[0] // 2
    q_out = torch.empty((rows, num_heads, 2 * half), dtype=x.dtype, device=x.device)
    cfg = {"num_warps": 4, **(config or gemv_config(rows, pairs, k, True, True, weight_scale is not None))}
    _qkv_rope_store_kernel[(triton.cdiv(pairs, cfg["BLOCK_N"]),)](
        x, weight, weight_scale if weight_scale is not None else x, bias if bias is not None else x, norm_weight, cos,
        sin, slot_mapping, q_out, k_cache, v_cache,
        rows, k, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), cos.stride(0),
        q_out.stride(0), q_out.stride(1), *k_cache.stride(), *v_cache.stride(), eps, num_heads, num_kv_heads,
        1.0 / k_scale, 1.0 / v_scale,
        HALF=half, BLOCK_SIZE=k_cache.shape[1], HAS_BIAS=bias is not None, HAS_SCALE=weight_scale is not None,
        ONE_TILE=k <= cfg["BLOCK_K"], **cfg, **pdl(x),
    )
    return q_out
