"""A GEMM at decode's 1-16 tokens with the weight's rows as the MMA's M (64 or 128 a tile: on
Hopper a wgmma, which reads e4m3 as it is) and the tokens as its N (16: the rows padded), against
the engine's paths at those rows: kernels/gemm.py's tokens-as-M GEMM at its tiles (fp8_gemm_config
for FP8 weights, gemm_config for bf16), the GEMV at one row (kernels/gemv.py, its input quantized
in each program for FP8) and cuBLAS for bf16. The layout CUTLASS's small-batch kernels use; the
rejected table has it for FP8 at 8-128 rows without a K split (2026-12-03). Here a deep weight's K
may be split over programs, the last of a tile adding the parts in order, as kernels/gemm.py does.

Each timing is 28 calls on 28 weights (a step's worth, none in L2) replayed from a CUDA graph, us
per call; the GEMM alone (FP8: the activations quantized before, not timed; the GEMV quantizes
its row itself). The best four tiles per projection and row count, and the best's error against
fp32 sums of the same operands.

Usage: PYTHONPATH=. python benchmarks/kernels/swapped_gemm.py [fp8|bf16] [ROWS ...]  (default: fp8 1 8 16)
       PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/kernels/swapped_gemm.py check  (CPU: the kernel
         against fp32 sums at small shapes, fp16 and FP8 operands, split and not)"""

import itertools
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from picovllm.kernels.gemm import gemm_triton
from picovllm.kernels.triton_utils import pdl, pdl_wait

LAYERS = 28
SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}


@triton.jit
def _swapped_kernel(
    a,
    a_scale,
    weight,
    weight_scale,
    out,
    partial,
    arrivals,
    M,
    N,
    K,
    k_per_split,
    s_am,
    s_wn,
    s_om,
    FP8: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    nmask, mmask = n < N, m < M
    k_start = tl.program_id(2) * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    pdl_wait(USE_PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < k_end
        wt = tl.load(weight + n[:, None] * s_wn + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        xt = tl.load(a + m[None, :] * s_am + k[:, None], mask=mmask[None, :] & kmask[:, None], other=0.0)
        acc = tl.dot(wt, xt, acc, max_num_imprecise_acc=32 if FP8 else None)
    omask = nmask[:, None] & mmask[None, :]
    nm = m[None, :] * N + n[:, None]
    if SPLIT:  # (the tile's parts to the workspace; the last to arrive adds them in order)
        tl.store(partial + tl.program_id(2) * M * N + nm, acc, mask=omask)
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        if tl.atomic_add(arrivals + tile, 1, sem="acq_rel") == tl.num_programs(2) - 1:
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for s in range(tl.num_programs(2)):
                acc += tl.load(partial + s * M * N + nm, mask=omask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(arrivals + tile, 0)
            _store(acc, a_scale, weight_scale, out, n, m, nmask, mmask, s_om, FP8)
    else:
        _store(acc, a_scale, weight_scale, out, n, m, nmask, mmask, s_om, FP8)


@triton.jit
def _store(acc, a_scale, weight_scale, out, n, m, nmask, mmask, s_om, FP8: tl.constexpr):
    if FP8:
        acc *= tl.load(weight_scale + n, mask=nmask, other=0.0)[:, None]
        acc *= tl.load(a_scale + m, mask=mmask, other=0.0)[None, :]
    tl.store(out + m[None, :] * s_om + n[:, None], acc.to(out.dtype.element_ty), mask=nmask[:, None] & mmask[None, :])


_ARRIVALS = {}


def swapped(a, w, dtype, cfg, a_scale=None, w_scale=None):
    m, k = a.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=dtype, device=a.device)
    split = min(cfg["SPLIT_K"], triton.cdiv(k, cfg["BLOCK_K"]))
    k_per_split = triton.cdiv(triton.cdiv(k, cfg["BLOCK_K"]), split) * cfg["BLOCK_K"]
    split = triton.cdiv(k, k_per_split)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, 16), split)
    arrivals = _ARRIVALS.setdefault(a.device, torch.zeros(8192, dtype=torch.int32, device=a.device))
    partial = torch.empty((split, m, n), dtype=torch.float32, device=a.device) if split > 1 else out
    fp8 = w_scale is not None
    _swapped_kernel[grid](
        a,
        a_scale if fp8 else out,
        w,
        w_scale if fp8 else out,
        out,
        partial,
        arrivals,
        m,
        n,
        k,
        k_per_split,
        a.stride(0),
        w.stride(0),
        out.stride(0),
        FP8=fp8,
        SPLIT=split > 1,
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_M=16,
        BLOCK_K=cfg["BLOCK_K"],
        num_warps=4,
        num_stages=cfg["num_stages"],
        **pdl(a),
    )
    return out


def check() -> None:
    from picovllm.kernels.fp8_gemm import fp8_gemm_ref, per_token_fp8_ref
    from picovllm.model.layers.fp8 import quantize_fp8

    g = torch.Generator().manual_seed(0)
    for m, n, k, split in ((1, 70, 300, 1), (9, 130, 300, 3)):
        x = torch.randn(m, k, generator=g)
        w = torch.randn(n, k, generator=g) / k**0.5
        cfg = dict(BLOCK_N=64, BLOCK_K=64, num_stages=2, SPLIT_K=split)
        got = swapped(x.half(), w.half(), torch.float32, cfg)
        ref = x.half().float() @ w.half().float().t()
        wq, ws = quantize_fp8(w)
        a, s = per_token_fp8_ref(x)
        got8 = swapped(a, wq, torch.float32, cfg, s, ws)
        ref8 = fp8_gemm_ref(a, s, wq, ws, None, None, torch.float32)
        print(
            f"m={m} split={split}: fp16 error {(got - ref).abs().max() / ref.abs().max():.1e}, "
            f"fp8 error {(got8 - ref8).abs().max() / ref8.abs().max():.1e}"
        )


def main(kind: str, row_counts: list[int]) -> None:
    from benchmarks.kernels.gemv_sweep import bench
    from picovllm.kernels.fp8_gemm import fp8_gemm_ref, fp8_gemm_triton, per_token_fp8_triton
    from picovllm.kernels.gemv import gemv_triton
    from picovllm.model.layers.fp8 import quantize_fp8

    dt = torch.bfloat16
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=dt) * 0.02 for _ in range(LAYERS)]
        quantized = [quantize_fp8(w) for w in weights] if kind == "fp8" else None
        for rows in row_counts:
            x = torch.randn(rows, k, device="cuda", dtype=dt)
            a, s = per_token_fp8_triton(x) if kind == "fp8" else (x, None)
            ways = {}
            if kind == "fp8":
                ways["engine's GEMM"] = lambda: [fp8_gemm_triton(a, s, q, qs, None, None, dt) for q, qs in quantized]
                if rows == 1:
                    ways["GEMV"] = lambda: [gemv_triton(x, q, weight_scale=qs) for q, qs in quantized]
            else:
                ways["cuBLAS"] = lambda: [F.linear(x, w) for w in weights]
                if rows > 1:
                    ways["engine's GEMM"] = lambda: [gemm_triton(x, w, None, None, dt) for w in weights]
                else:
                    ways["GEMV"] = lambda: [gemv_triton(x, w) for w in weights]
            base = " | ".join(f"{way} {bench(fn, 3, 3) / LAYERS * 1e6:.2f}" for way, fn in ways.items())
            results = []
            for bn, bk, stages, split in itertools.product((64, 128), (128, 256, 512), (3, 4, 5), (1, 2, 4, 8)):
                if split > 1 and triton.cdiv(n, bn) * split > 132 * 4:
                    continue
                cfg = dict(BLOCK_N=bn, BLOCK_K=bk, num_stages=stages, SPLIT_K=split)
                pairs = quantized or [(w, None) for w in weights]
                try:
                    t = bench(lambda: [swapped(a, q, dt, cfg, s, qs) for q, qs in pairs], 3, 3)
                except Exception:  # (shared memory)
                    continue
                results.append((t / LAYERS * 1e6, cfg))
            results.sort(key=lambda r: r[0])
            q, qs = (quantized or [(weights[0], None)])[0]
            ref = fp8_gemm_ref(a, s, q, qs, None, None, torch.float32) if qs is not None else a.float() @ q.float().t()
            got = swapped(a, q, torch.float32, results[0][1], s, qs)
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            best = "; ".join(
                f"{t:.2f} {c['BLOCK_N']}x{c['BLOCK_K']} st={c['num_stages']} split={c['SPLIT_K']}"
                for t, c in results[:4]
            )
            print(f"{name:8s} rows={rows:3d} {kind}: {base} | swapped best {best} (error {err:.1e})", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["check"]:
        check()
    else:
        kind = sys.argv[1] if sys.argv[1:2] in (["fp8"], ["bf16"]) else "fp8"
        main(kind, [int(r) for r in sys.argv[2 if sys.argv[1:2] in (["fp8"], ["bf16"]) else 1 :]] or [1, 8, 16])
