"""FP8 linear layers at more than one row (quantization="fp8", model/layers/fp8.py): vLLM's W8A8
dynamic scheme, the activations quantized per token, then a GEMM on Hopper's FP8 tensor cores
with a scale per row of each operand.

- per_token_fp8_triton: vLLM's dynamic per-token scaled_fp8_quant: each row scaled so that its largest
  magnitude is e4m3's largest; one program a row, which norms the row first when the layer takes
  its input's RMSNorm, or takes SiLU*mul of a gate_up row's halves for the down projection from
  SILU_MUL_FUSED_MIN_ROWS rows (the norm's or the activation's own kernel spared).
- fp8_gemm: out = residual + (a * a_scale) @ (weight * weight_scale).T + bias, the sums in fp32
  (on every tile), the scales, bias and residual in the epilogue (rounded as the unfused ops
  round: the output to the model dtype, then the residual sum). Each program streams BLOCK_N
  weight rows over BLOCK_M tokens, over all of K or, for a deep weight, its share of K (SPLIT_K
  programs a tile, the last to finish adding them up); at decode's few tokens the weight's bytes
  set the time, so the tiles keep enough programs in flight (fp8_gemm_config). A wide weight
  (gate_up) at 65-256 tokens takes all of them in one 128-token tile, read through TMA
  descriptors (Hopper's copy engine), where the same tile loaded by the threads ran slower.
- fp8_linear: the two, or past SCALED_MM_MIN_ROWS tokens in bf16 (prompts) cuBLAS's FP8 GEMM
  (torch._scaled_mm), which measured faster there (benchmarks/kernels/fp8_gemm.py).
"""
from __future__ import annotations

import functools

import torch

from picovllm.kernels.rms_norm import rms_norm_ref, rms_norm_row
from picovllm.kernels.silu_mul import silu_mul_ref, silu_mul_values
from picovllm.kernels.triton_utils import hopper_or_later, next_pow2, pdl, pdl_wait, tl, triton, use_triton
from picovllm.model.layers.fp8 import FP8, FP8_MAX

try:
    from triton.tools.tensor_descriptor import TensorDescriptor

    HAS_TMA = True
except ImportError:  # (no Triton, or one without host-side tensor descriptors)
    HAS_TMA = False

SCALED_MM_MIN_ROWS = 257  # (fp8_linear)
# From this many rows the MLP's SiLU*mul runs in the kernel quantizing the down projection's input
# (one program a row, model/qwen2.py); below, its own kernel, whose grid also splits the row, was
# faster at decode's batches of 8-128 (benchmarks/README.md, the FP8 section).
SILU_MUL_FUSED_MIN_ROWS = 129
MAX_TILES = 8192  # (a split GEMM's tiles: _arrivals)
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
    y = (a.float() @ weight.float().t()) * a_scale * weight_scale[None, :]
    if bias is not None:
        y = y + bias.float()
    y = y.to(dtype)
    return y if residual is None else (residual.float() + y.float()).to(dtype)


@triton.jit
def _fp8_epilogue(acc, m, n, mmask, nmask, a_scale, w_scale, bias, residual, out, s_rm, s_om,
                  HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The fp32 sums scaled, the bias and the residual added, stored in the output's dtype."""
    dt = out.dtype.element_ty
    acc *= tl.load(a_scale + m, mask=mmask, other=0.0)[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    y = acc.to(dt)
    omask = mmask[:, None] & nmask[None, :]
    if HAS_RESIDUAL:
        res = tl.load(residual + m[:, None] * s_rm + n[None, :], mask=omask, other=0.0)
        y = (y.to(tl.float32) + res.to(tl.float32)).to(dt)
    tl.store(out + m[:, None] * s_om + n[None, :], y, mask=omask)


@triton.jit
def _fp8_gemm_kernel(a, a_scale, weight, weight_scale, bias, residual, out, partial, arrivals, a_desc, w_desc, M, N,
                     K, k_per_split, s_am, s_wn, s_rm, s_om, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     SPLIT: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    m0 = tl.program_id(1) * BLOCK_M
    n = n0 + tl.arange(0, BLOCK_N)
    m = m0 + tl.arange(0, BLOCK_M)
    nmask = n < N
    mmask = m < M
    w_scale = tl.load(weight_scale + n, mask=nmask, other=0.0)
    k_start = tl.program_id(2) * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    pdl_wait(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if TMA:  # (the tiles by the copy engine; past M, N and K it reads zeros; a split ends on a tile)
            at = a_desc.load([m0, k0])
            wt = w_desc.load([n0, k0]).T
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < k_end
            at = tl.load(a + m[:, None] * s_am + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            wt = tl.load(weight + n[None, :] * s_wn + k[:, None], mask=nmask[None, :] & kmask[:, None], other=0.0)
        # Hopper's 64-token FP8 tiles (wgmma) add in less than fp32's precision, and Triton's
        # default on sm_90 never promotes them: greedy tokens then drift from the reference. Each
        # instruction's 32 products go to the fp32 sum.
        acc = tl.dot(at, wt, acc, max_num_imprecise_acc=32)
    if not SPLIT:
        _fp8_epilogue(acc, m, n, mmask, nmask, a_scale, w_scale, bias, residual, out, s_rm, s_om, HAS_BIAS,
                      HAS_RESIDUAL)
    else:
        # Each split's sums to the workspace; the last split of the tile to arrive adds them all, in
        # split order (the same result whichever arrives last), and resets the tile's counter.
        omask = mmask[:, None] & nmask[None, :]
        mn = m[:, None] * N + n[None, :]
        tl.store(partial + tl.program_id(2) * M * N + mn, acc, mask=omask)
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        if tl.atomic_add(arrivals + tile, 1, sem="acq_rel") == tl.num_programs(2) - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(tl.num_programs(2)):
                acc += tl.load(partial + s * M * N + mn, mask=omask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(arrivals + tile, 0)
            _fp8_epilogue(acc, m, n, mmask, nmask, a_scale, w_scale, bias, residual, out, s_rm, s_om, HAS_BIAS,
                          HAS_RESIDUAL)


@functools.cache
def _arrivals(device: torch.device) -> torch.Tensor:
    """The split GEMM's arrival counters, one a tile, zero between calls (each call's last split
    resets its tile's): allocated once per device, before any CUDA graph's capture. Shared by
    every call on the device, which holds because a device's GEMMs run one after another (the
    model's forward is one stream)."""
    return torch.zeros(MAX_TILES, dtype=torch.int32, device=device)


def fp8_gemm_config(m: int, n: int, k: int, exact: bool = False) -> dict:
    """Tiles for m tokens of an [n, k] FP8 weight: all of them in one tile up to 64 (the weight read
    once), and narrow weight tiles, 16 rows for a weight of at most 2,048, 32 beyond; a weight at
    least four times deeper than it has rows (the down projection: 1,536 rows, 8,960 deep) has its
    K split over 8 programs a tile up to 32 tokens, 4 beyond (else its 1,536 rows make 96-192
    programs). A wide weight (more than 2,048 rows: gate_up) at 65-256 tokens: 128 tokens by 64
    rows a tile through TMA descriptors; the others (qkv, o) at 129-256 tokens 64 rows by 128 deep
    in 5 stages. Chosen from sweeps at 8, 64, 128 and 256 rows (benchmarks/kernels/fp8_gemm.py
    sweep).
    exact: at most 32 tokens a tile. Hopper's 64-token FP8 tiles (wgmma) sum, even promoted every
    32 products, less exactly than fp32 (the error in benchmarks/README.md's FP8 section): below the
    rounding of a bf16 or fp16 output, not of an fp32 one; smaller tiles sum in fp32 (mma)."""
    block_m = max(16, min(32 if exact else 64, next_pow2(m)))
    deep = k >= 4 * n
    if block_m == 64 and m > 64 and n > 2048 and not deep:  # (gate_up at 65-256 tokens)
        return dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, TMA=True)
    if block_m == 64:
        if deep:
            few = m <= 128
            return dict(BLOCK_M=64, BLOCK_N=32 if few else 64, BLOCK_K=256 if few else 128, num_warps=4,
                        num_stages=3 if few else 4, SPLIT_K=4)
        if n > 2048 or m > 128:  # (64 rows by 128 deep: gate_up up to 64 tokens; qkv and o at 129-256 in 5 stages)
            return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3 if n > 2048 else 5)
        return dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=512, num_warps=4, num_stages=3)  # (33-128: 512 deep)
    if deep:
        return dict(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4, SPLIT_K=8)
    return dict(BLOCK_M=block_m, BLOCK_N=16 if n <= 2048 else 32, BLOCK_K=256, num_warps=4, num_stages=5)


def _tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether tiles of these e4m3 matrices can be read by TMA descriptors: a GPU that has TMA
    (Hopper on; Ada's FP8 GEMM loads by pointers; the CPU's interpreter has them), rows
    contiguous, each row and the start 16-byte aligned."""
    return (
        HAS_TMA
        and all(hopper_or_later(t) or not t.is_cuda for t in tensors)
        and all(t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 for t in tensors)
    )


def fp8_gemm_triton(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None, residual: torch.Tensor | None, dtype: torch.dtype,
                    config: dict | None = None) -> torch.Tensor:
    """config: the tiles (fp8_gemm_config's), SPLIT_K, how many programs share each tile's K (1 when
    not given), and TMA, the tiles read through TMA descriptors (where the matrices allow it)."""
    m, k = a.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=dtype, device=a.device)
    cfg = dict(config or fp8_gemm_config(m, n, k, exact=dtype == torch.float32))
    block_k = cfg["BLOCK_K"]
    split = min(cfg.pop("SPLIT_K", 1), triton.cdiv(k, block_k))
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split) * block_k
    split = triton.cdiv(k, k_per_split)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split)
    a_desc = w_desc = None
    if cfg.pop("TMA", False) and _tma_ready(a, weight):
        a_desc = TensorDescriptor.from_tensor(a, [cfg["BLOCK_M"], block_k])
        w_desc = TensorDescriptor.from_tensor(weight, [cfg["BLOCK_N"], block_k])
    if split > 1:
        assert grid[0] * grid[1] <= MAX_TILES, f"{grid[0] * grid[1]} tiles, more than {MAX_TILES}"
        partial, arrivals = torch.empty((split, m, n), dtype=torch.float32, device=a.device), _arrivals(a.device)
    else:
        partial = arrivals = out
    res = residual if residual is not None else out
    _fp8_gemm_kernel[grid](a, a_scale, weight, weight_scale, bias if bias is not None else out, res, out, partial,
                           arrivals, a_desc, w_desc, m, n, k, k_per_split, a.stride(0), weight.stride(0),
                           res.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                           HAS_RESIDUAL=residual is not None, SPLIT=split > 1, TMA=a_desc is not None, **cfg,
                           **pdl(a))
    return out


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
