"""A bf16 layer's GEMMs at decode's 2-64 tokens: cuBLAS (F.linear with the bias, addmm into the
residual: what linear() ran there before) against kernels/gemm.py's weight-streaming GEMM at
gemm_config's tiles and at the tiles of a sweep (weight rows and depth a tile, stages, a split of
K), each timed as 28 calls on 28 weights (a step's worth, none in L2) replayed from a CUDA graph
(GPU only), in us per call; the best four tiles per projection and row count, and the best's
error against fp32 sums.

With --wide, the sweep also takes 8 warps, 4 stages, a split of 2 and loads by TMA descriptors
(the weight tiles by the copy engine); --only NAME[,NAME] sweeps those projections alone.

Usage: PYTHONPATH=. python benchmarks/kernels/gemm.py [--wide] [--only down,qkv] [ROWS ...]  (default: 8 64)"""

import argparse
import itertools

import torch
import torch.nn.functional as F

from benchmarks.kernels.gemv_sweep import SHAPES, bench
from picovllm.kernels.gemm import gemm_config, gemm_triton

LAYERS = 28


def main(row_counts: list[int], names: list[str], wide: bool) -> None:
    dt = torch.bfloat16
    for name in names:
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
            block_m = gemm_config(rows, n, k)["BLOCK_M"]
            results = []
            stages_, warps_ = ((3, 4, 5), (4, 8)) if wide else ((3, 5), (4,))
            splits = ((1, 4, 8) if name == "down" else (1, 4)) + ((2,) if wide else ())
            for bn, bk, stages, warps, split, tma in itertools.product(
                (16, 32, 64), (64, 128, 256), stages_, warps_, splits, (False, True) if wide else (False,)
            ):
                cfg = dict(
                    BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, SPLIT_K=split, TMA=tma
                )
                try:
                    results.append((streamed(cfg) / LAYERS * 1e6, cfg))
                except Exception:  # (shared memory)
                    continue
            results.sort(key=lambda r: r[0])
            ref = x.float() @ weights[0].float().t() + (bias.float() if bias is not None else 0)
            got = gemm_triton(x, weights[0], bias, None, dt, config=results[0][1]).float()
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            best = "; ".join(
                f"{t:.2f} bn={c['BLOCK_N']} bk={c['BLOCK_K']} st={c['num_stages']} w={c['num_warps']} "
                f"split={c['SPLIT_K']}{' tma' if c['TMA'] else ''}"
                for t, c in results[:4]
            )
            print(
                f"{name:8s} rows={rows:3d} cuBLAS {base:6.2f} | default {default:6.2f} {gemm_config(rows, n, k)} | "
                f"best {best} (error {err:.1e})",
                flush=True,
            )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", type=int, nargs="*", default=[8, 64])
    ap.add_argument("--only", default="down,gate_up,qkv,o")
    ap.add_argument("--wide", action="store_true")
    args = ap.parse_args()
    main(args.rows, args.only.split(","), args.wide)
