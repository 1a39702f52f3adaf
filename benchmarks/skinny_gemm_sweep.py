"""A plain Triton GEMM for 64 rows (a batch-64 decode step, a warm prefix hit padded to 64 tokens)
on tensor cores, with split-K, against cuBLAS on Qwen2.5-1.5B's projections: is there room under
cuBLAS at these shapes? Each timing is 56 calls replayed from a CUDA graph (timed_us), the weights
rotating over 8 copies so that none is read from L2 (gemv_sweep.py reuses one weight). Split-K timings
are the kernel alone: its fp32 atomics' output would still need zeroing and converting.
An experiment, not a kernel of the engine (results: benchmarks/README.md, tenth session).

Usage: PYTHONPATH=. python benchmarks/skinny_gemm_sweep.py           (GPU; ONLY=gate_up,down to pick
         projections; WIDE=1 for the wider grid: more stages and warps, split-K 1-2)
       TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/skinny_gemm_sweep.py check   (CPU, fp16: the
         kernel against torch on small odd shapes; bf16 on the GPU)"""
import functools
import itertools
import os
import sys

import torch

from benchmarks.gemv_sweep import bench
from picovllm.kernels.triton_utils import tl, triton

SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}


@triton.jit
def _skinny(x, w, out, M, N, K, s_xm, s_wn, s_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k0 = pid_k * k_per
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(k0, tl.minimum(k0 + k_per, K), BLOCK_K, num_stages=STAGES):
        rk = k + tl.arange(0, BLOCK_K)
        a = tl.load(x + rm[:, None] * s_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        b = tl.load(w + rn[None, :] * s_wn + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)
        acc += tl.dot(a, b)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        tl.store(out + rm[:, None] * s_om + rn[None, :], acc.to(out.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out + rm[:, None] * s_om + rn[None, :], acc, mask=mask, sem="relaxed")


def skinny(x, w, cfg, ws=None, kernel_only=False):
    M, K = x.shape
    N = w.shape[0]
    bn, bk, split, stages, warps = cfg
    if split == 1:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    else:
        out = ws[:M * N].view(M, N)
        if not kernel_only:
            out.zero_()
    _skinny[(triton.cdiv(N, bn), split)](x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
                                        BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=bn, BLOCK_K=bk,
                                        SPLIT_K=split, STAGES=stages, num_warps=warps)
    return out if split == 1 or kernel_only else out.to(x.dtype)


def timed_us(fns: list) -> float:
    """us per call of the fns taking turns (each with its own copy of the weights), timed by
    gemv_sweep.bench: 56 calls replayed from one CUDA graph, the median of three replays."""
    calls = itertools.cycle(fns)
    return bench(lambda: next(calls)(), reps=56, rounds=3) * 1e6


def check():
    dt = torch.float16 if os.environ.get("TRITON_INTERPRET") else torch.bfloat16
    dev = "cpu" if os.environ.get("TRITON_INTERPRET") else "cuda"
    torch.manual_seed(0)
    for (M, N, K), cfg in [((43, 96, 320), (32, 64, 1, 2, 4)), ((64, 80, 512), (32, 64, 4, 2, 4)),
                           ((5, 64, 200), (64, 128, 2, 2, 4))]:
        x = torch.randn(M, K, dtype=dt, device=dev); w = torch.randn(N, K, dtype=dt, device=dev) / K ** 0.5
        ws = torch.empty(M * N, dtype=torch.float32, device=dev)
        ref = (x.float() @ w.float().t())
        got = skinny(x, w, cfg, ws).float()
        err = (got - ref).abs().max().item()
        print(f"check M{M} N{N} K{K} cfg {cfg}: max err {err:.4f}")
        assert err < 0.05, err


def main():
    dev = torch.device("cuda")
    M = 64
    x = torch.randn(M, 8960, dtype=torch.bfloat16, device=dev)
    ws = torch.empty(M * 17920, dtype=torch.float32, device=dev)
    for name, (N, K) in SHAPES.items():
        if os.environ.get("ONLY") and name not in os.environ["ONLY"].split(","):
            continue
        ws_ = [torch.randn(N, K, dtype=torch.bfloat16, device=dev) / K ** 0.5 for _ in range(8)]
        xs = x[:, :K].contiguous()
        floor = N * K * 2 / 4.8e12 * 1e6
        cub = timed_us([functools.partial(torch.mm, xs, w.t()) for w in ws_])
        ref = (xs.float() @ ws_[0].float().t())
        res = []
        grid = (itertools.product((64, 128, 256), (64, 128), (1, 2), (3, 4, 5, 6), (4, 8)) if os.environ.get("WIDE")
                else itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8), (4,), (4,)))
        for bn, bk, split, stages, warps in grid:
            if K // split < bk:
                continue
            cfg = (bn, bk, split, stages, warps)
            try:
                got = skinny(xs, ws_[0], cfg, ws)
            except triton.runtime.errors.OutOfResources:  # (tiles over the shared memory)
                continue
            err = (got.float() - ref).abs().max().item()
            us = timed_us([functools.partial(skinny, xs, w, cfg, ws, kernel_only=True) for w in ws_])
            res.append((us, cfg, err))
        res.sort()
        print(f"M{M} {name} N{N} K{K}: floor {floor:.1f} us, cuBLAS {cub:.1f} us; best Triton: "
              + "; ".join(f"{us:.1f} us {cfg} err {err:.3f}" for us, cfg, err in res[:6]), flush=True)


if __name__ == "__main__":
    check() if sys.argv[1:] == ["check"] else main()
