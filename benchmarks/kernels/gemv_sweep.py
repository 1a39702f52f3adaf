"""Our GEMV (kernels/gemv.py) against cuBLAS on Qwen2.5-1.5B's projections, over a sweep of tile
sizes; each timing is 50 calls replayed from a CUDA graph (GPU only). cuBLAS times the GEMM alone:
the GEMV also does the work of the norm / SiLU*mul / add kernels it replaces in the model, which
this does not count.

Usage: PYTHONPATH=. python benchmarks/kernels/gemv_sweep.py [ROWS ...]  (default: 1)
       PYTHONPATH=. python benchmarks/kernels/gemv_sweep.py projections
         one row at the default tiles: each projection 28 times in a row (each its own weights,
         graphed under PDL), its time per call and bandwidth; the LM head alone; a copy's bandwidth
       PYTHONPATH=. python benchmarks/kernels/gemv_sweep.py chain [fp8]
         one row, as the model runs it: a batch-1 step's 113 GEMVs (28 layers x qkv with norm and bias,
         o with residual, gate_up with norm and SiLU*mul, down with residual; the LM head with norm),
         each layer its own weights, replayed from one CUDA graph (with programmatic dependent launch,
         as in the engine); for each projection in turn, every candidate tile
         with the others at their defaults; then the best of each together. fp8: the four
         projections' weights in e4m3 with a scale per row (quantization="fp8"; the LM head stays bf16)."""

import itertools
import sys
import time

import torch
import torch.nn.functional as F

from picovllm.kernels.gemv import gemv_config, gemv_triton
from picovllm.model.layers.fp8 import quantize_fp8

SHAPES = {
    "qkv": (2048, 1536),
    "o": (1536, 1536),
    "gate_up": (17920, 1536),
    "down": (1536, 8960),
    "lm_head": (151936, 1536),
}


def bench(fn, reps: int = 50, rounds: int = 1) -> float:
    """Seconds per call of fn: `reps` calls captured in one CUDA graph, replayed once untimed, then
    the median of `rounds` timed replays."""
    for _ in range(3):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / reps)
    return sorted(times)[len(times) // 2]


def tile_candidates(rows: int):
    """(config, warps) pairs."""
    block_m = 1 << (rows - 1).bit_length()
    for bn, bk, warps in itertools.product((1, 2, 4, 8, 16, 32), (256, 512, 1024, 2048), (4, 8)):
        if block_m * bn * bk <= 32768:
            yield dict(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk), warps


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
                    results.append(
                        (
                            bench(lambda: gemv_triton(x, w, config={**cfg, "num_warps": warps}), reps=20),
                            cfg["BLOCK_N"],
                            cfg["BLOCK_K"],
                            warps,
                        )
                    )
                except Exception:  # a tile too large for the registers or shared memory
                    continue
            results.sort()
            t, bn, bk, warps = results[0]
            print(
                f"rows={rows} {name:8s} cuBLAS {t_cublas * 1e6:7.1f}us {gb / t_cublas:6.0f}GB/s | default "
                f"{gemv_config(rows, n, k)} {t_default * 1e6:7.1f}us {gb / t_default:6.0f}GB/s | best BLOCK_N={bn} "
                f"BLOCK_K={bk} warps={warps} {t * 1e6:7.1f}us {gb / t:6.0f}GB/s",
                flush=True,
            )


CHAIN_LAYERS = 28


def chain(fp8: bool = False, reps: int = 20, rounds: int = 5) -> None:
    dev, dt = "cuda", torch.bfloat16
    hidden, eps = 1536, 1e-6
    layers = [
        {name: torch.randn(*SHAPES[name], device=dev, dtype=dt) * 0.02 for name in ("qkv", "o", "gate_up", "down")}
        for _ in range(CHAIN_LAYERS)
    ]
    scales = [dict.fromkeys(w) for w in layers]
    if fp8:
        for w, s in zip(layers, scales):
            for name in w:
                w[name], s[name] = quantize_fp8(w[name])
    lm_head = torch.randn(*SHAPES["lm_head"], device=dev, dtype=dt) * 0.02
    qkv_bias, norm_w = torch.randn(2048, device=dev, dtype=dt), torch.ones(hidden, device=dev, dtype=dt)
    h = torch.randn(1, hidden, device=dev, dtype=dt)
    attn, act = torch.randn(1, 1536, device=dev, dtype=dt), torch.randn(1, 8960, device=dev, dtype=dt)

    def step(cfgs: dict) -> None:
        for w, s in zip(layers, scales):  # (data flow does not matter: each kernel waits for the one before)
            gemv_triton(h, w["qkv"], qkv_bias, norm_w, eps, weight_scale=s["qkv"], config=cfgs.get("qkv"))
            gemv_triton(attn, w["o"], residual=h, weight_scale=s["o"], config=cfgs.get("o"))
            gemv_triton(
                h, w["gate_up"], None, norm_w, eps, silu_mul=True, weight_scale=s["gate_up"], config=cfgs.get("gate_up")
            )
            gemv_triton(act, w["down"], residual=h, weight_scale=s["down"], config=cfgs.get("down"))
        gemv_triton(h, lm_head, None, norm_w, eps, config=cfgs.get("lm_head"))

    def timed(cfgs: dict) -> float:
        """Median over rounds of the mean step time of `reps` graphed steps, us."""
        return bench(lambda: step(cfgs), reps, rounds) * 1e6

    def candidates(name: str):
        k = SHAPES[name][1]
        widths = (1, 2, 4, 8) if k > 2048 else (4, 8, 16, 32) if name == "lm_head" else (1, 2, 4, 8, 16)
        if fp8 and name != "lm_head":
            widths = (2, 4, 8, 16) if k > 2048 else (2, 4, 8, 16, 32)
        warp_counts = (1, 2, 4, 8) if fp8 and k <= 2048 else (4, 8, 16) if fp8 else (1, 2, 4, 8, 16)
        for bn, bk, warps in itertools.product(widths, (2048, 4096, 8192), warp_counts):
            rows_loaded = 2 * bn if name == "gate_up" else bn
            budget = 65536 if fp8 and name != "lm_head" else 32768  # (elements a program loads: bytes for fp8)
            if rows_loaded * bk > budget or (k <= 2048 and bk > 2048) or (k > 2048 and warps < 2):
                continue
            yield dict(BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)

    base = timed({})
    defaults = {
        p: gemv_config(
            1,
            n // 2 if p == "gate_up" else n,
            k,
            norm=p in ("qkv", "gate_up", "lm_head"),
            silu_mul=p == "gate_up",
            fp8=fp8 and p != "lm_head",
        )
        for p, (n, k) in SHAPES.items()
    }
    print(
        f"chain of {4 * CHAIN_LAYERS + 1} GEMVs at one row, default tiles: {base:.1f} us per step ({defaults})",
        flush=True,
    )
    best = {}
    for name in SHAPES:
        if fp8 and name == "lm_head":  # (bf16 as without fp8)
            continue
        results = []
        for cfg in candidates(name):
            try:
                results.append((timed({name: cfg}), cfg))
            except Exception:  # a tile too large for the registers or shared memory
                continue
        results.sort(key=lambda r: r[0])
        again = timed({})
        print(
            f"{name:8s} default {base:.1f} (again {again:.1f}) | best: "
            + "; ".join(f"{t:.1f} bn={c['BLOCK_N']} bk={c['BLOCK_K']} w={c['num_warps']}" for t, c in results[:4]),
            flush=True,
        )
        if results and results[0][0] < min(base, again) - 2.0:
            best[name] = results[0][1]
    if best:
        print(f"all best together: {timed(best):.1f} us (default {timed({}):.1f}): {best}", flush=True)


def projections() -> None:
    dev, dt, eps = "cuda", torch.bfloat16, 1e-6
    norm_w, h = torch.ones(1536, device=dev, dtype=dt), torch.randn(1, 1536, device=dev, dtype=dt)
    inputs = {"qkv": h, "o": torch.randn(1, 1536, device=dev, dtype=dt), "gate_up": h,
              "down": torch.randn(1, 8960, device=dev, dtype=dt), "lm_head": h}  # fmt: skip
    kwargs = {"qkv": dict(bias=torch.randn(2048, device=dev, dtype=dt), norm_weight=norm_w, eps=eps),
              "o": dict(residual=h), "gate_up": dict(norm_weight=norm_w, eps=eps, silu_mul=True),
              "down": dict(residual=h), "lm_head": dict(norm_weight=norm_w, eps=eps)}  # fmt: skip
    for name, shape in SHAPES.items():
        count = 1 if name == "lm_head" else CHAIN_LAYERS
        weights = [torch.randn(*shape, device=dev, dtype=dt) * 0.02 for _ in range(count)]
        t = bench(lambda: [gemv_triton(inputs[name], w, **kwargs[name]) for w in weights], 10, 5) / count
        print(f"{name:8s} x{count}: {t * 1e6:7.2f} us each, {shape[0] * shape[1] * 2 / t / 1e9:6.0f} GB/s", flush=True)
    src = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    print(f"copy: {2 * src.numel() / bench(lambda: dst.copy_(src), 20, 5) / 1e9:.0f} GB/s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["chain"]:
        chain(fp8=sys.argv[2:] == ["fp8"])
    elif sys.argv[1:] == ["projections"]:
        projections()
    else:
        main([int(r) for r in sys.argv[1:]] or [1])
