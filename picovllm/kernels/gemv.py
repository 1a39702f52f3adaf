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

from picovllm.kernels.rms_norm import rms_norm_ref
from picovllm.kernels.silu_mul import silu_mul_ref
from picovllm.kernels.triton_utils import next_pow2, pdl, pdl_wait, tl, triton

MAX_ROWS = 16  # rows in one program (registers); the model uses one


def fused_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                     residual: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
    """What gemv_triton computes, op by op. weight: [N, K], or [2I, K] for silu_mul (gate rows,
    then up rows)."""
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps)
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
def _weight_tiles(weight, n, k, nmask, K, s_wn, s_wk, up_offset, SILU_MUL: tl.constexpr):
    """Weight rows n over columns k (past K: masked, nothing read), and with SILU_MUL the matching
    up rows (n + up_offset) of a fused gate_up (without it, wu is w: unused)."""
    wmask = nmask[:, None] & (k[None, :] < K)
    w = tl.load(weight + n[:, None] * s_wn + k[None, :] * s_wk, mask=wmask, other=0.0)
    wu = w
    if SILU_MUL:
        wu = tl.load(weight + (n[:, None] + up_offset) * s_wn + k[None, :] * s_wk, mask=wmask, other=0.0)
    return w, wu


@triton.jit
def _rows_times_tile(xv, w):
    """[M, K] rows times an [N, K] weight tile, transposed: [M, N] in fp32, reduced on CUDA cores."""
    return tl.sum(xv[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _gemv_kernel(
    x, weight, bias, norm_weight, residual, out,
    M, N, K, s_xm, s_xk, s_wn, s_wk, s_rm, s_om, up_offset, eps,
    HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    dt = out.dtype.element_ty
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    nmask = n < N
    mmask = m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if ONE_TILE:  # K <= BLOCK_K: weight loads are issued first, their latency hides the norm's
        k = tl.arange(0, BLOCK_K)
        kmask = k < K
        w, wu = _weight_tiles(weight, n, k, nmask, K, s_wn, s_wk, up_offset, SILU_MUL)
        pdl_wait(USE_PDL)  # (with PDL the weight loads also overlap the previous kernel)
        xv = tl.load(x + m[:, None] * s_xm + k[None, :] * s_xk, mask=mmask[:, None] & kmask[None, :],
                     other=0.0).to(tl.float32)
        if HAS_NORM:
            rstd = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=1) / K + eps)
            xv = _normed(xv, rstd, norm_weight, k, kmask, dt)
        acc += _rows_times_tile(xv, w)
        if SILU_MUL:
            acc_up += _rows_times_tile(xv, wu)
    else:
        # the first weight tile's loads before the wait (ONE_TILE issues all of them there), each
        # next tile's after the current one's products
        w, wu = _weight_tiles(weight, n, tl.arange(0, BLOCK_K), nmask, K, s_wn, s_wk, up_offset, SILU_MUL)
        pdl_wait(USE_PDL)
        if HAS_NORM:  # each row's 1 / rms, from a first pass over the (cached) input
            sq = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                xv = tl.load(x + m[:, None] * s_xm + k[None, :] * s_xk, mask=mmask[:, None] & (k[None, :] < K),
                             other=0.0).to(tl.float32)
                sq += xv * xv
            rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=1) / K + eps)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            xv = tl.load(x + m[:, None] * s_xm + k[None, :] * s_xk, mask=mmask[:, None] & kmask[None, :],
                         other=0.0).to(tl.float32)
            if HAS_NORM:
                xv = _normed(xv, rstd, norm_weight, k, kmask, dt)
            acc += _rows_times_tile(xv, w)
            if SILU_MUL:
                acc_up += _rows_times_tile(xv, wu)
            w, wu = _weight_tiles(weight, n, k + BLOCK_K, nmask, K, s_wn, s_wk, up_offset, SILU_MUL)  # the next
    if HAS_BIAS:
        acc += tl.load(bias + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    y = acc.to(dt)
    if SILU_MUL:
        gate = y.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt)  # rounded like F.silu's output
        y = (act.to(tl.float32) * acc_up.to(dt).to(tl.float32)).to(dt)
    omask = mmask[:, None] & nmask[None, :]
    if HAS_RESIDUAL:
        res = tl.load(residual + m[:, None] * s_rm + n[None, :], mask=omask, other=0.0)
        y = (y.to(tl.float32) + res.to(tl.float32)).to(dt)
    tl.store(out + m[:, None] * s_om + n[None, :], y, mask=omask)


def gemv_config(rows: int, n: int, k: int, norm: bool = False, silu_mul: bool = False) -> dict:
    """Tiles and warps for `rows` rows of an [n, k] weight (n outputs: with silu_mul each program
    reads 2 weight rows per output); norm: the RMSNorm is fused in. Swept on a Hopper GPU at one row
    as the model runs them, a whole step's GEMVs graphed under programmatic dependent launch
    (benchmarks/kernels/gemv_sweep.py chain). K in one tile (up to 2,048): with the norm fused,
    4 weight rows per program on one warp (both reductions stay within the warp: no shared
    memory, no barrier); without (the o projection), 8 rows on 2 warps. Deeper K (the down
    projection): 4,096-wide tiles of 4 rows on 8 warps."""
    block_m = next_pow2(rows)
    if k > 2048:
        return dict(BLOCK_M=block_m, BLOCK_N=4, BLOCK_K=4096, num_warps=8)
    if norm:
        return dict(BLOCK_M=block_m, BLOCK_N=2 if silu_mul else 4, BLOCK_K=max(16, next_pow2(k)), num_warps=1)
    return dict(BLOCK_M=block_m, BLOCK_N=8, BLOCK_K=max(16, next_pow2(k)), num_warps=2)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                residual: torch.Tensor | None = None, silu_mul: bool = False,
                config: dict | None = None) -> torch.Tensor:
    rows, k = x.shape
    assert rows <= MAX_ROWS, f"gemv serves at most {MAX_ROWS} rows, got {rows}"
    assert not (silu_mul and bias is not None), "a fused gate_up has no bias"
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    cfg = {"num_warps": 4, **(config or gemv_config(rows, n, k, norm_weight is not None, silu_mul))}
    res = residual if residual is not None else out
    _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, weight, bias if bias is not None else weight, norm_weight if norm_weight is not None else weight,
        res, out, rows, n, k, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        res.stride(0), out.stride(0), n, eps,
        HAS_BIAS=bias is not None, HAS_NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None,
        SILU_MUL=silu_mul, ONE_TILE=k <= cfg["BLOCK_K"], **cfg, **pdl(x),
    )
    return out
