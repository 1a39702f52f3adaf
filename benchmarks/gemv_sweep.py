"""Our GEMV (kernels/gemv.py) against cuBLAS on Qwen2.5-1.5B's projections at 1 to 64 rows (CUDA
cores at one row, tensor cores from two), over a sweep of tile sizes; each timing is 50 calls
replayed from a CUDA graph (GPU only). cuBLAS times the GEMM alone: the GEMV also does the work
of the norm / SiLU*mul / add kernels it replaces in the model, which this does not count.

Usage: PYTHONPATH=. python benchmarks/gemv_sweep.py [ROWS ...]  (default: 8 16 40 64; one row was swept in the second session)"""
import itertools
import sys
import time

import torch
import torch.nn.functional as F

from picovllm.kernels.gemv import gemv_config, gemv_triton

SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960),
          "lm_head": (151936, 1536)}


def bench(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def tile_candidates(rows: int):
    """(config, warps) pairs: CUDA-core tiles at one row, tensor-core tiles from two."""
    if rows == 1:
        for bn, bk, warps in itertools.product((1, 2, 4, 8, 16, 32), (256, 512, 1024, 2048), (4, 8)):
            if bn * bk <= 32768:
                yield dict(BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, DOT=False), warps
    else:
        block_m = max(16, 1 << (rows - 1).bit_length())
        for bn, bk, warps in itertools.product((16, 32, 64, 128), (64, 128, 256), (4, 8)):
            yield dict(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, DOT=True), warps


def main(row_counts: list[int]) -> None:
    for rows in row_counts:
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            gb = n * k * 2 / 1e9
            t_cublas = bench(lambda: F.linear(x, w))
            t_default = bench(lambda: gemv_triton(x, w))
            results = []
            for cfg, warps in tile_candidates(rows):
                if cfg["BLOCK_K"] > 2 * k:
                    continue
                try:
                    results.append((bench(lambda: gemv_triton(x, w, config=cfg, num_warps=warps), reps=20),
                                    cfg["BLOCK_N"], cfg["BLOCK_K"], warps))
                except Exception:  # a tile too large for the registers or shared memory
                    continue
            results.sort()
            t, bn, bk, warps = results[0]
            print(f"rows={rows} {name:8s} cuBLAS {t_cublas * 1e6:7.1f}us {gb / t_cublas:6.0f}GB/s | default "
                  f"{gemv_config(rows, n, k)} {t_default * 1e6:7.1f}us {gb / t_default:6.0f}GB/s | best BLOCK_N={bn} "
                  f"BLOCK_K={bk} warps={warps} {t * 1e6:7.1f}us {gb / t:6.0f}GB/s", flush=True)


if __name__ == "__main__":
    main([int(r) for r in sys.argv[1:]] or [8, 16, 40, 64])
