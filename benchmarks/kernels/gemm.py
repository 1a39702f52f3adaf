"""A bf16 layer's GEMMs at decode's 2-64 tokens: cuBLAS (F.linear with the bias, addmm into the
residual: what linear() ran there before) against kernels/gemm.py's weight-streaming GEMM at
gemm_config's tiles and at the tiles of a sweep (weight rows and depth a tile, stages, a split of
K), each timed as 28 calls on 28 weights (a step's worth, none in L2) replayed from a CUDA graph
(GPU only), in us per call; the best four tiles per projection and row count, and the best's
error against fp32 sums.

Usage: PYTHONPATH=. python benchmarks/kernels/gemm.py [ROWS ...]  (default: 8 64)"""

import itertools
import sys

import torch
import torch.nn.functional as F

from benchmarks.kernels.gemv_sweep import SHAPES, bench
from picovllm.kernels.gemm import gemm_config, gemm_triton
from picovllm.kernels.triton_utils import next_pow2

LAYERS = 28


def main(row_counts: list[int]) -> None:
    dt = torch.bfloat16
    for name in ("down", "gate_up", "qkv", "o"):
        n, k = SHAPES[name]
        weights = [torch.randn(n, k, device="cuda", dtype=dt) * 0.02 for _ in range(LAYERS)]
        bias = torch.randn(n, device="cuda", dtype=dt) if name == "qkv" else None
        for rows in row_counts:
            x = torch.randn(rows, k, device="cuda", dtype=dt)
            residual = torch.randn(rows, n, device="cuda", dtype=dt) if name in ("o", "down") else None
            if residual is not None:
                cublas = lambda: [residual.addmm_(x, w.t()) for w in weights]  # noqa: E731
            else:
                cublas = lambda: [F.linear(x, w, bias) for w in weights]  # noqa: E731

            def streamed(cfg=None):
                return bench(lambda: [gemm_triton(x, w, bias, residual, dt, config=cfg) for w in weights], 3, 3)

            base, default = bench(cublas, 3, 3) / LAYERS * 1e6, streamed() / LAYERS * 1e6
            block_m = max(16, min(64, next_pow2(rows)))
            results = []
            for bn, bk, stages in itertools.product((16, 32, 64), (64, 128, 256), (3, 5)):
                for split in (1, 4, 8) if name == "down" else (1, 4):
                    cfg = dict(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=stages, SPLIT_K=split)
                    try:
                        results.append((streamed(cfg) / LAYERS * 1e6, cfg))
                    except Exception:  # (shared memory)
                        continue
            results.sort(key=lambda r: r[0])
            ref = x.float() @ weights[0].float().t() + (bias.float() if bias is not None else 0)
            got = gemm_triton(x, weights[0], bias, None, dt, config=results[0][1]).float()
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            best = "; ".join(
                f"{t:.2f} bn={c['BLOCK_N']} bk={c['BLOCK_K']} st={c['num_stages']} split={c['SPLIT_K']}"
                for t, c in results[:4]
            )
            print(
                f"{name:8s} rows={rows:3d} cuBLAS {base:6.2f} | default {default:6.2f} {gemm_config(rows, n, k)} | "
                f"best {best} (error {err:.1e})",
                flush=True,
            )


if __name__ == "__main__":
    main([int(r) for r in sys.argv[1:]] or [8, 64])
