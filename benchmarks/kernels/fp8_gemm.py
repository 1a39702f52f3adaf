"""FP8 weights at more than one row (quantization="fp8"): the ways to multiply `rows` activations by
Qwen2.5-1.5B's projections, each timed as 28 calls on 28 weights (a step's worth, none in L2)
replayed from a CUDA graph (GPU only), in us per call:

- bf16: F.linear on the bf16 weight (the unquantized model);
- scaled_mm: the activations quantized per token, then torch._scaled_mm with a scale per row of
  each operand (cuBLAS on Hopper's FP8 tensor cores);
- w8a8: kernels/fp8_gemm.py at its default tiles, the activations quantized per token first (the
  quantization included), as quantization="fp8" runs up to 256 rows;
- gemv: kernels/gemv.py on the FP8 bytes (up to 16 rows).

Usage: PYTHONPATH=. python benchmarks/kernels/fp8_gemm.py [ROWS ...]  (default: 1 2 4 8 16 32 64 128 256 2048)
       PYTHONPATH=. python benchmarks/kernels/fp8_gemm.py sweep [ROWS ...]  (default: 8 128)
         fp8_gemm's tiles swept (tokens, weight rows and depth a tile, stages, warps, the split
         of K, loads by TMA descriptors), the best six per projection and row count, and the
         best's error
       PYTHONPATH=. python benchmarks/kernels/fp8_gemm.py accuracy
         fp8_gemm's error by token tile against fp32 sums of the same operands (max |out - ref| /
         max |ref|), with fp32 and bf16 outputs"""

import itertools
import sys

import torch
import torch.nn.functional as F
import triton

from benchmarks.kernels.gemv_sweep import SHAPES, bench
from picovllm.kernels.fp8_gemm import fp8_gemm_config, fp8_gemm_ref, fp8_gemm_triton, per_token_fp8_triton
from picovllm.kernels.gemv import MAX_ROWS, gemv_triton
from picovllm.kernels.triton_utils import next_pow2
from picovllm.model.layers.fp8 import quantize_fp8

LAYERS = 28
PROJECTIONS = ("qkv", "o", "gate_up", "down")


def _weights(name: str):
    n, k = SHAPES[name]
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    return weights, [quantize_fp8(w) for w in weights]


def main(row_counts: list[int]) -> None:
    dt = torch.bfloat16
    for name in PROJECTIONS:
        weights, quantized = _weights(name)
        for rows in row_counts:
            x = torch.randn(rows, SHAPES[name][1], device="cuda", dtype=dt)

            def scaled_mm(q, s):
                a, a_scale = per_token_fp8_triton(x)
                return torch._scaled_mm(a, q.t(), scale_a=a_scale, scale_b=s[None, :], out_dtype=dt)

            def w8a8(q, s):
                return fp8_gemm_triton(*per_token_fp8_triton(x), q, s, None, None, dt)

            ways = {
                "bf16": lambda: [F.linear(x, w) for w in weights],
                "scaled_mm": lambda: [scaled_mm(q, s) for q, s in quantized],
                "w8a8": lambda: [w8a8(q, s) for q, s in quantized],
            }
            if rows <= MAX_ROWS:
                ways["gemv"] = lambda: [gemv_triton(x, q, weight_scale=s) for q, s in quantized]
            times = {}
            for way, fn in ways.items():
                try:
                    times[way] = bench(fn, 5, 5) / LAYERS * 1e6
                except Exception as e:  # (a way this GPU or torch lacks)
                    times[way] = float("nan")
                    print(f"  {way}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            line = " | ".join(f"{w} {t:7.2f}" for w, t in times.items())
            print(f"{name:8s} rows={rows:5d} {line} us", flush=True)


def sweep(row_counts: list[int]) -> None:
    dt = torch.bfloat16
    for name in ("down", "gate_up", "qkv", "o"):  # (the largest losses first)
        weights, quantized = _weights(name)
        n, k = SHAPES[name]
        for rows in row_counts:
            a, a_scale = per_token_fp8_triton(torch.randn(rows, k, device="cuda", dtype=dt))
            results = []
            block_ms = sorted({max(16, min(64, next_pow2(rows))), max(16, min(128, next_pow2(rows)))})
            for block_m, bn, bk, stages, warps, tma in itertools.product(
                block_ms, (16, 32, 64, 128), (128, 256, 512), (3, 4, 5), (4, 8), (False, True)
            ):
                if (warps == 8 and block_m * bn < 128 * 64) or (bk == 512 and block_m * bn > 64 * 32):
                    continue
                if tma and block_m < 64:
                    continue
                for split in (1, 2, 4, 8):
                    if split > 1 and triton.cdiv(n, bn) * triton.cdiv(rows, block_m) * split > 132 * 6:
                        continue
                    cfg = dict(
                        BLOCK_M=block_m,
                        BLOCK_N=bn,
                        BLOCK_K=bk,
                        num_warps=warps,
                        num_stages=stages,
                        SPLIT_K=split,
                        TMA=tma,
                    )
                    try:
                        t = bench(
                            lambda: [fp8_gemm_triton(a, a_scale, q, s, None, None, dt, cfg) for q, s in quantized],
                            3,
                            3,
                        )
                    except Exception:  # (shared memory)
                        break
                    results.append((t / LAYERS * 1e6, cfg))
            results.sort(key=lambda r: r[0])
            best = "; ".join(
                f"{t:.2f} bm={c['BLOCK_M']} bn={c['BLOCK_N']} bk={c['BLOCK_K']} st={c['num_stages']} "
                f"w={c['num_warps']} split={c['SPLIT_K']}{' tma' if c['TMA'] else ''}"
                for t, c in results[:6]
            )
            q, s = quantized[0]
            ref = fp8_gemm_ref(a, a_scale, q, s, None, None, torch.float32)
            err = (fp8_gemm_triton(a, a_scale, q, s, None, None, dt, results[0][1]).float() - ref).abs().max()
            print(
                f"{name:8s} rows={rows:5d} default {fp8_gemm_config(rows, n, k)} | best {best} "
                f"(the best's error against fp32 sums {err / ref.abs().max():.1e})",
                flush=True,
            )


def accuracy() -> None:
    g = torch.Generator().manual_seed(0)
    for (m, n, k), dt in itertools.product(
        [(130, 256, 64), (265, 1536, 1536), (130, 1536, 8960)], [torch.float32, torch.bfloat16]
    ):
        x = torch.randn(m, k, generator=g).to(dt).cuda()
        q, s = quantize_fp8((torch.randn(n, k, generator=g) / k**0.5).to(dt).cuda())
        a, a_scale = per_token_fp8_triton(x)
        ref = fp8_gemm_ref(a.cpu(), a_scale.cpu(), q.cpu(), s.cpu(), None, None, torch.float32).double()
        errors = []
        for block_m in (16, 32, 64):
            cfg = dict(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3)
            out = fp8_gemm_triton(a, a_scale, q, s, None, None, dt, cfg).cpu().double()
            errors.append(f"{block_m} tokens {((out - ref).abs().max() / ref.abs().max()).item():.1e}")
        print(f"{m} x {n} x {k}, {dt}: " + ", ".join(errors), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["accuracy"]:
        accuracy()
    elif sys.argv[1:2] == ["sweep"]:
        sweep([int(r) for r in sys.argv[2:]] or [8, 128])
    else:
        main([int(r) for r in sys.argv[1:]] or [1, 2, 4, 8, 16, 32, 64, 128, 256, 2048])
