"""FP8 linear layers past one row, and at one for a deep or wide weight (quantization="fp8",
model/layers/fp8.py; the others' one row is kernels/gemv.py's): vLLM's W8A8
dynamic scheme, the activations quantized per token, then a GEMM on Hopper's FP8 tensor cores
with a scale per row of each operand.

- per_token_fp8_triton: vLLM's dynamic per-token scaled_fp8_quant: each row scaled so that its largest
  magnitude is e4m3's largest; one program a row, which norms the row first when the layer takes
  its input's RMSNorm, or takes SiLU*mul of a gate_up row's halves for the down projection from
  SILU_MUL_FUSED_MIN_ROWS rows and at one (the norm's or the activation's own kernel spared).
- fp8_gemm_triton: out = residual + (a * a_scale) @ (weight * weight_scale).T + bias by
  kernels/gemm.py's weight-streaming GEMM (the sums in fp32 on every tile; the scales, bias and
  residual in its epilogue) at fp8_gemm_config's tiles: enough programs in flight at decode's
  few tokens, whose weight's bytes set the time; a weight of more than 2,048 rows (gate_up) at
  65-256 tokens takes all of them in one 128-token tile, read through TMA descriptors (Hopper's
  copy engine), where the same tile loaded by the threads ran slower.
- fp8_linear: the two, or past SCALED_MM_MIN_ROWS tokens in bf16 (prompts) cuBLAS's FP8 GEMM
  (torch._scaled_mm), which measured faster there (benchmarks/kernels/fp8_gemm.py).
"""
from __future__ import annotations

import torch

from picovllm.kernels.gemm import deep, gemm_triton
from picovllm.kernels.rms_norm import rms_norm_ref, rms_norm_row
from picovllm.kernels.silu_mul import silu_mul_ref, silu_mul_values
from picovllm.kernels.triton_utils import next_pow2, pdl, pdl_wait, tl, triton, use_triton
from picovllm.model.layers.fp8 import FP8, FP8_MAX, fp8_to_float

SCALED_MM_MIN_ROWS = 257  # (fp8_linear)
# From this many rows (and at one) the MLP's SiLU*mul runs in the kernel quantizing the down
# projection's input (one program a row, model/qwen2.py); below, its own kernel, whose grid also
# splits the row, was faster at decode's batches of 8-128 (benchmarks/README.md, the FP8 section).
SILU_MUL_FUSED_MIN_ROWS = 129
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # (vLLM's floor: an all-zero row gets this scale and zeros)


def to_fp8_ref(x: torch.Tensor, inv_scale) -> torch.Tensor:
    """x (in fp32) times its scale's reciprocal in e4m3: clamped to e4m3's range, rounded to nearest
    even (to_fp8 in a kernel; also an FP8 KV cache's store, kernels/kv_store.py)."""
    return (x.float() * inv_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def per_token_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in e4m3, fp32 scale per row [rows, 1]): x ~= e4m3 * scale; x times the scale's reciprocal,
    rounded to nearest even (vLLM's arithmetic: one division a row)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return to_fp8_ref(xf, 1.0 / scale), scale


@triton.jit
def fp8_row_scale(amax):
    """A row's scale from its largest magnitude, as per_token_fp8_ref's: amax / FP8_MAX (448), at
    least MIN_SCALE."""
    return tl.maximum(amax / 448.0, 1.0 / (448.0 * 512.0))


@triton.jit
def to_fp8(xv, inv_scale):
    """fp32 values times their scale's reciprocal in e4m3, as to_fp8_ref rounds them (to nearest
    even)."""
    return tl.clamp(xv * inv_scale, -448.0, 448.0).to(tl.float8e4nv)


@triton.jit
def _per_token_fp8_kernel(x, norm_weight, out, scale, K, s_xm, s_om, eps, HAS_NORM: tl.constexpr,
                          SILU_MUL: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    m = tl.program_id(0)
    k = tl.arange(0, BLOCK_K)
    mask = k < K
    dt = x.dtype.element_ty
    if HAS_NORM:
        w = tl.load(norm_weight + k, mask=mask, other=0.0)
    pdl_wait(USE_PDL)
    xv = tl.load(x + m * s_xm + k, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        xv = rms_norm_row(xv, w, K, eps, dt).to(tl.float32)
    if SILU_MUL:  # (x: a gate_up output, gate then up)
        up = tl.load(x + m * s_xm + K + k, mask=mask, other=0.0).to(tl.float32)
        xv = silu_mul_values(xv, up, dt).to(tl.float32)
    s = fp8_row_scale(tl.max(tl.abs(xv), axis=0))
    tl.store(out + m * s_om + k, to_fp8(xv, 1.0 / s), mask=mask)
    tl.store(scale + m, s)


def per_token_fp8_triton(x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                         silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """per_token_fp8_ref's, of rms_norm(x, norm_weight, eps) when norm_weight is given, of
    silu_mul(x) when silu_mul is (the norm or the activation in the same kernel)."""
    rows, k = x.shape[0], x.shape[1] // 2 if silu_mul else x.shape[1]
    out = torch.empty((rows, k), dtype=FP8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    block = next_pow2(k)
    _per_token_fp8_kernel[(rows,)](x, norm_weight if norm_weight is not None else x, out, scale, k, x.stride(0),
                                   out.stride(0), eps, HAS_NORM=norm_weight is not None, SILU_MUL=silu_mul,
                                   BLOCK_K=block, num_warps=min(16, max(1, block // 512)), **pdl(x))
    return out, scale


def fp8_gemm_ref(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None, residual: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """What fp8_gemm_triton computes: a [M, K] in e4m3 with a_scale [M, 1], weight [N, K] in e4m3 with
    weight_scale [N]; the output in dtype."""
    y = (fp8_to_float(a) @ fp8_to_float(weight).t()) * a_scale * weight_scale[None, :]
    if bias is not None:
        y = y + bias.float()
    y = y.to(dtype)
    return y if residual is None else (residual.float() + y.float()).to(dtype)


def fp8_gemm_config(m: int, n: int, k: int, exact: bool = False) -> dict:
    """Tiles for m tokens of an [n, k] FP8 weight: all of them in one tile up to 64 (the weight read
    once), and narrow weight tiles, 16 rows for a weight of at most 2,048, 32 beyond; a weight at
    least four times deeper than it has rows (the down projection: 1,536 rows, 8,960 deep) has its
    K split over 8 programs a tile up to 32 tokens, 4 beyond (else its 1,536 rows make 96-192
    programs). A weight of more than 2,048 rows (gate_up) at 1-16 tokens: 32 rows by 128 deep a
    tile in 4 stages; at 65-256 tokens: 128 tokens by 64 rows a tile through TMA descriptors. The
    others (qkv, o) at 129-256 tokens: 64 rows by 128 deep in 5 stages. Chosen from sweeps at 1, 2,
    8, 16, 64, 128 and 256 rows (benchmarks/kernels/fp8_gemm.py sweep).
    exact: at most 32 tokens a tile. Hopper's 64-token FP8 tiles (wgmma) sum, even promoted every
    32 products, less exactly than fp32 (the error in benchmarks/README.md's FP8 section): below the
    rounding of a bf16 or fp16 output, not of an fp32 one; smaller tiles sum in fp32 (mma)."""
    block_m = max(16, min(32 if exact else 64, next_pow2(m)))
    split = deep(n, k)
    if block_m == 64 and m > 64 and n > 2048 and not split:  # (gate_up at 65-256 tokens)
        return dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, TMA=True)
    if block_m == 64:
        if split:
            few = m <= 128
            return dict(BLOCK_M=64, BLOCK_N=32 if few else 64, BLOCK_K=256 if few else 128, num_warps=4,
                        num_stages=3 if few else 4, SPLIT_K=4)
        if n > 2048 or m > 128:  # (64 rows by 128 deep: gate_up up to 64 tokens; qkv and o at 129-256 in 5 stages)
            return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3 if n > 2048 else 5)
        return dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=512, num_warps=4, num_stages=3)  # (33-128: 512 deep)
    if split:
        return dict(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4, SPLIT_K=8)
    if block_m == 16 and n > 2048:  # (gate_up at 1-16 tokens)
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)
    return dict(BLOCK_M=block_m, BLOCK_N=16 if n <= 2048 else 32, BLOCK_K=256, num_warps=4, num_stages=5)


def fp8_gemm_triton(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None, residual: torch.Tensor | None, dtype: torch.dtype,
                    config: dict | None = None) -> torch.Tensor:
    """What fp8_gemm_ref computes, by kernels/gemm.py's GEMM; config: its tiles (fp8_gemm_config's
    when not given)."""
    config = config or fp8_gemm_config(a.shape[0], weight.shape[0], a.shape[1], exact=dtype == torch.float32)
    return gemm_triton(a, weight, bias, residual, dtype, a_scale, weight_scale, config)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor | None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
               silu_mul: bool = False) -> torch.Tensor:
    """residual + x @ (weight * weight_scale).T + bias, the activations quantized per token: on the
    GPU fp8_gemm, or cuBLAS's from SCALED_MM_MIN_ROWS rows in bf16 (its scales per row need a bf16
    output); elsewhere the reference. norm_weight: x's RMSNorm first (with eps); silu_mul: x is a
    gate_up output, SiLU*mul of its halves first; either in the kernel that quantizes it."""
    if not use_triton(x) or x.dim() != 2:
        if norm_weight is not None:
            x = rms_norm_ref(x, norm_weight, eps)
        if silu_mul:
            x = silu_mul_ref(x)
        return fp8_gemm_ref(*per_token_fp8_ref(x), weight, weight_scale, bias, residual, x.dtype)
    a, a_scale = per_token_fp8_triton(x, norm_weight, eps, silu_mul)
    if x.is_cuda and x.dtype == torch.bfloat16 and x.shape[0] >= SCALED_MM_MIN_ROWS:
        y = torch._scaled_mm(a, weight.t(), scale_a=a_scale, scale_b=weight_scale[None, :], bias=bias,
                             out_dtype=x.dtype)
        return y if residual is None else residual.add_(y)
    return fp8_gemm_triton(a, a_scale, weight, weight_scale, bias, residual, x.dtype)
