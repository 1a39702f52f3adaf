"""Would a persistent kernel pay at batch 1? The question behind the decode issue's next step (a
megakernel): a batch-1 step's GEMVs as one persistent kernel against the same GEMVs as the engine
launches them (kernels/gemv.py, one kernel each, graphed under programmatic dependent launch).

The chain is a step's 112 layer GEMVs without their fused extras (norm, bias, SiLU*mul, residual):
per layer qkv (2,048 x 1,536) of h, o (1,536 x 1,536) of q's first 1,536, gate_up (17,920 x 1,536)
of o's output, down (1,536 x 8,960) of gate_up's first 8,960, which is the next layer's h; each
layer its own weights, 2.62 GB in all. The persistent kernel runs P programs (all resident at
once), each taking every P-th block of BN rows of each GEMV in turn; a GEMV starts once every
program has finished the one before (a grid barrier: an arrival counter in global memory), and a
program loads its first weight tile of the next GEMV before it waits there, as PDL lets the
engine's kernels do, and each next tile while it computes the current one.

Usage: PYTHONPATH=. python benchmarks/kernels/persistent_chain.py          (GPU: check, then time)
       TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/kernels/persistent_chain.py check
         (CPU: the kernel at small shapes with one program, against the PyTorch chain)"""

import itertools
import sys

import torch

from picovllm.kernels.triton_utils import tl, triton

LAYERS = 28
HIDDEN, QKV, GATE_UP, INTER = 1536, 2048, 17920, 8960


@triton.jit
def _wait(counter, target):
    """Until `target` programs have arrived (acquire: their stores are visible after it)."""
    seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")


@triton.jit
def _arrive(counter):
    """This program's stores done (every thread's: the barrier), then counted (release)."""
    tl.debug_barrier()
    tl.atomic_add(counter, 1, sem="release", scope="gpu")


@triton.jit
def _gemv_phase(
    w, x, y, N, K, counter, target, pid, P, BN: tl.constexpr, BK: tl.constexpr, KT: tl.constexpr, SYNC: tl.constexpr
):
    """y[n] = w[n, :K] . x[:K] (fp32 sums, rounded to y's dtype) for this program's blocks of BN
    rows (pid, pid + P, ...), K in KT tiles of BK, once `target` arrivals are counted; then arrive.
    The program's items are (block, K tile) pairs in a row: each next item's weight tile is loaded
    before the current one's products, the first before the wait (past its last item, or with no
    item, the block's rows are past N: nothing is loaded). Without SYNC no barrier (wrong results:
    the time of the streaming alone)."""
    rows = tl.arange(0, BN)
    ks = tl.arange(0, BK)
    total = tl.maximum(tl.cdiv(tl.cdiv(N, BN) - pid, P), 0) * KT
    n = pid * BN + rows
    wt = tl.load(w + n[:, None] * K + ks[None, :], mask=(n[:, None] < N) & (ks[None, :] < K), other=0.0)
    if SYNC:
        _wait(counter, target)
    acc = tl.zeros([BN], tl.float32)
    for j in range(0, total):
        n = (pid + (j // KT) * P) * BN + rows
        kt = j % KT
        k = kt * BK + ks
        xv = tl.load(x + k, mask=k < K, other=0.0, cache_modifier=".cg").to(tl.float32)
        j2 = j + 1
        n2 = (pid + (j2 // KT) * P) * BN + rows
        k2 = (j2 % KT) * BK + ks
        wn = tl.load(w + n2[:, None] * K + k2[None, :], mask=(n2[:, None] < N) & (k2[None, :] < K), other=0.0)
        acc += tl.sum(wt.to(tl.float32) * xv[None, :], axis=1)
        if kt == KT - 1:
            tl.store(y + n, acc.to(y.dtype.element_ty), mask=n < N)
            acc = tl.zeros([BN], tl.float32)
        wt = wn
    if SYNC:
        _arrive(counter)


@triton.jit
def _chain_kernel(
    w_qkv,
    w_o,
    w_gu,
    w_d,
    h,
    q,
    a,
    g,
    counter,
    P,
    H,
    QKV_N,
    GU_N,
    INTER_N,
    LAYERS: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    KT_H: tl.constexpr,
    KT_I: tl.constexpr,
    SYNC: tl.constexpr,
):
    pid = tl.program_id(0)
    for layer in range(LAYERS):
        base = layer * 4 * P  # (the offsets below fit in int32 at Qwen2.5-1.5B's shapes)
        _gemv_phase(w_qkv + layer * QKV_N * H, h, q, QKV_N, H, counter, base, pid, P, BN, BK, KT_H, SYNC)
        _gemv_phase(w_o + layer * H * H, q, a, H, H, counter, base + P, pid, P, BN, BK, KT_H, SYNC)
        _gemv_phase(w_gu + layer * GU_N * H, a, g, GU_N, H, counter, base + 2 * P, pid, P, BN, BK, KT_H, SYNC)
        _gemv_phase(w_d + layer * H * INTER_N, g, h, H, INTER_N, counter, base + 3 * P, pid, P, BN, BK, KT_I, SYNC)


def persistent_chain(
    w: dict, h: torch.Tensor, bufs: dict, programs: int, bn: int, bk: int, warps: int, sync: bool = True
):
    """The chain on h (in place), w's stacked weights: [layers, n, k] each; returns the launched
    kernel (Triton's, with its register count)."""
    layers, qkv_n, hidden = w["qkv"].shape
    gu_n, inter = w["gate_up"].shape[1], w["down"].shape[2]
    bufs["counter"].zero_()
    return _chain_kernel[(programs,)](
        w["qkv"], w["o"], w["gate_up"], w["down"], h, bufs["q"], bufs["a"], bufs["g"], bufs["counter"],
        programs, hidden, qkv_n, gu_n, inter,
        LAYERS=layers, BN=bn, BK=bk, KT_H=triton.cdiv(hidden, bk), KT_I=triton.cdiv(inter, bk), SYNC=sync,
        num_warps=warps,
    )  # fmt: skip


def chain_ref(w: dict, h: torch.Tensor) -> torch.Tensor:
    """The chain in PyTorch: fp32 products, each GEMV's output rounded to h's dtype."""
    hidden, inter = w["qkv"].shape[2], w["down"].shape[2]
    for layer in range(w["qkv"].shape[0]):
        q = (w["qkv"][layer].float() @ h.float()).to(h.dtype)
        a = (w["o"][layer].float() @ q[:hidden].float()).to(h.dtype)
        g = (w["gate_up"][layer].float() @ a.float()).to(h.dtype)
        h = (w["down"][layer].float() @ g[:inter].float()).to(h.dtype)
    return h


def make(layers: int, hidden: int, qkv: int, gate_up: int, inter: int, device: str, dtype) -> tuple:
    gen = torch.Generator(device="cpu").manual_seed(0)

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(layers, n, k, generator=gen) / k**0.5).to(device=device, dtype=dtype)

    w = {"qkv": weight(qkv, hidden), "o": weight(hidden, hidden), "gate_up": weight(gate_up, hidden),
         "down": weight(hidden, inter)}  # fmt: skip
    h = torch.randn(hidden, generator=gen).to(device=device, dtype=dtype)
    bufs = {"q": torch.empty(qkv, device=device, dtype=dtype), "a": torch.empty(hidden, device=device, dtype=dtype),
            "g": torch.empty(gate_up, device=device, dtype=dtype),
            "counter": torch.zeros(1, device=device, dtype=torch.int32)}  # fmt: skip
    return w, h, bufs


def check(device: str, dtype, programs: int, shapes=(3, 64, 96, 320, 160), bn: int = 4, bk: int = 32) -> float:
    """max |kernel - reference| / max |reference| after the chain."""
    w, h, bufs = make(*shapes, device=device, dtype=dtype)
    ref = chain_ref(w, h.clone())
    persistent_chain(w, h, bufs, programs, bn, bk, 4)
    return ((h.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def resident(sms: int, warps: int, kernel) -> int:
    """Programs of `kernel` that fit on the GPU at once (by registers and threads: a persistent
    grid larger than this would wait forever at its first barrier)."""
    kernel._init_handles()
    regs = -(-kernel.n_regs * 32 // 256) * 256 * warps  # (a warp's registers come 256 at a time)
    props = torch.cuda.get_device_properties(0)
    per_sm = min(getattr(props, "regs_per_multiprocessor", 65536) // regs, 2048 // (32 * warps))
    return sms * per_sm


def main() -> None:
    from benchmarks.kernels.gemv_sweep import bench
    from picovllm.kernels.gemv import gemv_triton

    dt = torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    err = check("cuda", dt, 2 * sms, shapes=(4, HIDDEN, QKV, GATE_UP, INTER), bn=4, bk=512)
    print(f"check, 4 layers at full shapes, {2 * sms} programs: relative error {err:.2e}", flush=True)
    w, h, bufs = make(LAYERS, HIDDEN, QKV, GATE_UP, INTER, "cuda", dt)
    gb = sum(t.numel() for t in w.values()) * 2 / 1e9
    ref = chain_ref(w, h.clone())
    x = h.view(1, -1)

    def engine_chain() -> None:
        y = x
        for layer in range(LAYERS):
            q = gemv_triton(y, w["qkv"][layer])
            a = gemv_triton(q[:, :HIDDEN], w["o"][layer])
            g = gemv_triton(a, w["gate_up"][layer])
            y = gemv_triton(g[:, :INTER], w["down"][layer])

    base = bench(engine_chain, 10, 5) * 1e6
    print(f"engine's kernels (112, graphed, PDL): {base:.1f} us, {gb * 1e6 / base:.0f} GB/s", flush=True)
    results, scratch = [], h.clone()  # (the chain's input and output for each run after the check)
    for mult, bn, bk, warps in itertools.product((1, 2, 3), (2, 4, 8), (512, 1024, 2048), (4, 8)):
        programs = mult * sms
        if bn * bk > 2048 * warps:  # (a tile and the next: 64 registers a thread)
            continue
        fits = resident(sms, warps, persistent_chain(w, h.clone(), bufs, 1, bn, bk, warps))
        if programs > fits:
            print(f"persistent P={programs} BN={bn} BK={bk} warps={warps}: only {fits} fit", flush=True)
            continue
        persistent_chain(w, scratch.copy_(h), bufs, programs, bn, bk, warps)
        err = ((scratch.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        t = bench(lambda: persistent_chain(w, scratch, bufs, programs, bn, bk, warps), 10, 5) * 1e6  # noqa: B023
        results.append((t, programs, bn, bk, warps, err))
        print(f"persistent P={programs} BN={bn} BK={bk} warps={warps}: {t:.1f} us, {gb * 1e6 / t:.0f} GB/s, "
              f"error {err:.1e}", flush=True)  # fmt: skip
    results.sort()
    for t, p, bn, bk, wp, _ in results[:3]:  # (the barriers' share: the same streaming without them)
        free = bench(lambda: persistent_chain(w, scratch, bufs, p, bn, bk, wp, sync=False), 10, 5) * 1e6  # noqa: B023
        print(f"P={p} BN={bn} BK={bk} warps={wp}: {t:.1f} us, without the barriers {free:.1f} us", flush=True)
    print("best:", "; ".join(f"{t:.1f} us P={p} BN={bn} BK={bk} w={wp}" for t, p, bn, bk, wp, _ in results[:5]))
    print(f"engine's kernels again: {bench(engine_chain, 10, 5) * 1e6:.1f} us")


if __name__ == "__main__":
    if sys.argv[1:] == ["check"]:
        print(f"relative error, one program: {check('cpu', torch.float32, 1):.2e}")
    else:
        main()
