"""The GEMM at decode's few tokens on the tensor cores, streaming the weight: out = residual + a @
weight.T + bias, of bf16 or fp16 operands, or of FP8 (e4m3) ones with a scale per row of each
(a_scale per token, weight_scale per weight row: kernels/fp8_gemm.py's W8A8), the sums in fp32,
the scales, bias and residual in the epilogue (rounded as the unfused ops round: the output to
the model dtype, then the residual sum). A fused gate_up weight (the gate's rows, then the up's)
may have SiLU*mul of its two outputs in the epilogue too: each program then streams a tile of
the gate's rows and the same rows of the up's, in two sums.

Each program streams BLOCK_N weight rows over BLOCK_M tokens, over all of K or, for a deep weight,
its share of K (SPLIT_K programs a tile; each writes its fp32 sums to a workspace and the last
of a tile to arrive adds them in split order, so the result does not depend on which finishes
last). At decode's few tokens the weight's bytes set the time, so the tiles keep enough programs
in flight: gemm_config for bf16 and fp16 weights, fp8_gemm_config (kernels/fp8_gemm.py) for FP8.

A bf16 or fp16 layer's projections run here at 2-64 tokens on Hopper and later (streams: linear()
in model/layers/linear.py), where cuBLAS measured slower (benchmarks/README.md); FP8 weights from
2 to 256 tokens (fp8_linear).
"""
from __future__ import annotations

import functools

import torch

from picovllm.kernels.silu_mul import silu_mul_values
from picovllm.kernels.triton_utils import hopper_or_later, pdl, pdl_wait, tl, triton, use_triton

try:
    from triton.tools.tensor_descriptor import TensorDescriptor

    HAS_TMA = True
except ImportError:  # (no Triton, or one without host-side tensor descriptors)
    HAS_TMA = False

GEMM_MAX_ROWS = 64  # (streams)
MAX_WEIGHT_ROWS = 32768  # (streams: the LM head's vocabulary stays on cuBLAS)
MAX_TILES = 8192  # (a split GEMM's tiles: _arrivals)


def deep(n: int, k: int) -> bool:
    """Whether an [n, k] weight is at least four times deeper than it has rows (the down
    projection: 1,536 rows, 8,960 deep): the tiles split its K over programs (gemm_config,
    kernels/fp8_gemm.py's fp8_gemm_config), which reads an FP8 one faster than the GEMV at one
    row too (model/layers/linear.py)."""
    return k >= 4 * n


def wide(n: int, k: int) -> bool:
    """Whether an [n, k] weight has at least four times as many rows as it is deep (a fused gate_up:
    17,920 rows, 1,536 deep): an FP8 one is read faster at one row by the GEMM, its row quantized
    first, than by the GEMV (model/layers/linear.py)."""
    return n >= 4 * k


def streams(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x @ weight.T runs here for a bf16 or fp16 model: 2-64 rows (GEMM_MAX_ROWS; one row is
    the GEMV's, more cuBLAS's) on a Hopper GPU (where the tiles were chosen) or in the CPU's
    interpreter (fp16 there: its bf16 products are wrong), rows contiguous; a weight of at most
    MAX_WEIGHT_ROWS rows (the layers' projections: cuBLAS reads the LM head's 151,936 rows at 93%
    of copy bandwidth at 8 rows, benchmarks/README.md's batch-8 profile)."""
    return (
        x.dim() == 2
        and 2 <= x.shape[0] <= GEMM_MAX_ROWS
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(1) == 1
        and weight.shape[0] <= MAX_WEIGHT_ROWS
        and not weight.is_mkldnn  # (a CPU's packed weight: model/layers/linear.py's pack_weights)
        and use_triton(x)
        and (hopper_or_later(x) or (not x.is_cuda and x.dtype == torch.float16))
    )


@triton.jit
def _output(acc, m, n, mmask, nmask, a_scale, w_scale, bias, dt: tl.constexpr, HAS_SCALE: tl.constexpr,
            HAS_BIAS: tl.constexpr):
    """The fp32 sums of weight rows n scaled (FP8 operands: w_scale, their scales), the bias added,
    rounded to dt."""
    if HAS_SCALE:
        acc *= tl.load(a_scale + m, mask=mmask, other=0.0)[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    return acc.to(dt)


@triton.jit
def _epilogue(acc, m, n, mmask, nmask, a_scale, w_scale, bias, residual, out, s_rm, s_om,
              HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The fp32 sums scaled (FP8 operands), the bias and the residual added, stored in the output's
    dtype."""
    dt = out.dtype.element_ty
    y = _output(acc, m, n, mmask, nmask, a_scale, w_scale, bias, dt, HAS_SCALE, HAS_BIAS)
    omask = mmask[:, None] & nmask[None, :]
    if HAS_RESIDUAL:
        res = tl.load(residual + m[:, None] * s_rm + n[None, :], mask=omask, other=0.0)
        y = (y.to(tl.float32) + res.to(tl.float32)).to(dt)
    tl.store(out + m[:, None] * s_om + n[None, :], y, mask=omask)


@triton.jit
def _gemm_kernel(a, a_scale, weight, weight_scale, bias, residual, out, partial, arrivals, a_desc, w_desc, M, N,
                 K, k_per_split, s_am, s_wn, s_rm, s_om, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr, SPLIT: tl.constexpr, TMA: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """SILU_MUL: weight is [2N, K], the gate's N rows then the up's, and out [M, N] the SiLU*mul of
    the two products (rounded as silu_mul_ref rounds the unfused GEMM's output; bf16 or fp16
    operands, no residual, split or TMA)."""
    n0 = tl.program_id(0) * BLOCK_N
    m0 = tl.program_id(1) * BLOCK_M
    n = n0 + tl.arange(0, BLOCK_N)
    m = m0 + tl.arange(0, BLOCK_M)
    nmask = n < N
    mmask = m < M
    w_scale = tl.load(weight_scale + n, mask=nmask, other=0.0) if HAS_SCALE else None
    k_start = tl.program_id(2) * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    pdl_wait(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
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
        # instruction's 32 products go to the fp32 sum. (bf16 and fp16 tiles sum in fp32 anyway.)
        acc = tl.dot(at, wt, acc, max_num_imprecise_acc=32)
        if SILU_MUL:  # (the up's rows of the tile: pointer loads, bf16 or fp16)
            ut = tl.load(weight + (N + n[None, :]) * s_wn + k[:, None], mask=nmask[None, :] & kmask[:, None], other=0.0)
            up = tl.dot(at, ut, up)
    if SILU_MUL:
        dt = out.dtype.element_ty
        g = _output(acc, m, n, mmask, nmask, a_scale, w_scale, bias, dt, False, HAS_BIAS)  # (no scales: bf16, fp16)
        u = _output(up, m, N + n, mmask, nmask, a_scale, w_scale, bias, dt, False, HAS_BIAS)
        y = silu_mul_values(g.to(tl.float32), u.to(tl.float32), dt)
        tl.store(out + m[:, None] * s_om + n[None, :], y, mask=mmask[:, None] & nmask[None, :])
    elif not SPLIT:
        _epilogue(acc, m, n, mmask, nmask, a_scale, w_scale, bias, residual, out, s_rm, s_om, HAS_SCALE,
                  HAS_BIAS, HAS_RESIDUAL)
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
            _epilogue(acc, m, n, mmask, nmask, a_scale, w_scale, bias, residual, out, s_rm, s_om,
                      HAS_SCALE, HAS_BIAS, HAS_RESIDUAL)


@functools.cache
def _arrivals(device: torch.device) -> torch.Tensor:
    """The split GEMM's arrival counters, one a tile, zero between calls (each call's last split
    resets its tile's): allocated once per device, before any CUDA graph's capture. Shared by
    every call on the device, which holds because a device's GEMMs run one after another (the
    model's forward is one stream)."""
    return torch.zeros(MAX_TILES, dtype=torch.int32, device=device)


def gemm_config(m: int, n: int, k: int, silu_mul: bool = False) -> dict:
    """Tiles for m tokens (2-64) of an [n, k] bf16 or fp16 weight, from a sweep at 8 and 64 tokens
    (benchmarks/kernels/gemm.py): 16-row weight tiles 128 deep in 5 stages (qkv, o); a weight of
    more than 2,048 rows (gate_up) in 32-64-row tiles; a deep one (down: K at least four times its
    rows) split 4 ways. silu_mul (gate_up with SiLU*mul in the epilogue: 32 rows of the gate's and
    of the up's a program): 128 deep in 3 stages at up to 16 tokens, 64 deep in 4 beyond (a scratch
    sweep at 8 and 64 tokens). From 17 tokens a tile takes 64 (a step at 24 and 32 tokens 1% faster
    than in 32-token tiles: benchmarks/README.md)."""
    block_m = 16 if m <= 16 else 64
    few = block_m == 16
    if silu_mul:
        return dict(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=128 if few else 64, num_warps=4, num_stages=3 if few else 4)
    if deep(n, k):
        return dict(BLOCK_M=block_m, BLOCK_N=32 if few else 64, BLOCK_K=128 if few else 256, num_warps=4,
                    num_stages=5 if few else 3, SPLIT_K=4)
    if n > 2048:
        return dict(BLOCK_M=block_m, BLOCK_N=32 if few else 64, BLOCK_K=128 if few else 64, num_warps=4, num_stages=3)
    return dict(BLOCK_M=block_m, BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=5)


def _tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether tiles of these matrices can be read by TMA descriptors: a GPU that has TMA (Hopper
    on; Ada's FP8 GEMM loads by pointers; the CPU's interpreter has them), rows contiguous, each
    row and the start 16-byte aligned."""
    return (
        HAS_TMA
        and all(hopper_or_later(t) or not t.is_cuda for t in tensors)
        and all(t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 for t in tensors)
    )


def gemm_triton(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                dtype: torch.dtype, a_scale: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None,
                config: dict | None = None, silu_mul: bool = False) -> torch.Tensor:
    """residual + a @ weight.T + bias in dtype; a [M, K], weight [N, K], rows contiguous. FP8 operands
    come with a_scale [M, 1] and weight_scale [N]. silu_mul: weight is a fused gate_up's [2N, K]
    (the gate's rows, then the up's; a bias [2N] too), the output SiLU*mul of the two products,
    [M, N] (bf16 or fp16 operands; no residual). config: the tiles (gemm_config's when not given;
    fp8_gemm_config's for FP8), SPLIT_K, how many programs share each tile's K (1 when not given;
    none with silu_mul), and TMA, the tiles read through TMA descriptors (where the matrices
    allow it)."""
    m, k = a.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = torch.empty((m, n), dtype=dtype, device=a.device)
    cfg = dict(config or gemm_config(m, n, k, silu_mul))
    if silu_mul:
        assert weight_scale is None and residual is None, "SiLU*mul: bf16 or fp16 operands, no residual"
        assert cfg.get("SPLIT_K", 1) == 1 and not cfg.get("TMA"), "SiLU*mul: no split or TMA"
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
    scaled = weight_scale is not None
    # (what the call does not have: another tensor in its place, never read)
    _gemm_kernel[grid](a, a_scale if scaled else out, weight, weight_scale if scaled else out,
                       bias if bias is not None else out, res, out, partial, arrivals, a_desc, w_desc, m, n, k,
                       k_per_split, a.stride(0), weight.stride(0), res.stride(0), out.stride(0), HAS_SCALE=scaled,
                       HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, SILU_MUL=silu_mul,
                       SPLIT=split > 1, TMA=a_desc is not None, **cfg, **pdl(a))
    return out
