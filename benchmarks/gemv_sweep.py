"""Our GEMV (kernels/gemv.py) against cuBLAS on Qwen2.5-1.5B's projections at 1 and 8 rows, over a
sweep of tile sizes; each timing is 50 calls replayed from a CUDA graph. GPU only."""
import torch, time, itertools
from picovllm.kernels.gemv import gemv_triton, gemv_config
F = torch.nn.functional
shapes = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960), "lm_head": (151936, 1536)}
def bench(fn, reps=50):
    for _ in range(3): fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps): fn()
    g.replay(); torch.cuda.synchronize(); t = time.perf_counter(); g.replay(); torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps
best_cfgs = {}
for M in (1, 8):
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16); x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
        gb = n * k * 2 / 1e9
        tc = bench(lambda: F.linear(x, w))
        td = bench(lambda: gemv_triton(x, w))
        res = []
        bm = 1 << (M - 1).bit_length()
        for bn, bk, nw in itertools.product((1, 2, 4, 8, 16, 32), (256, 512, 1024, 2048), (4, 8)):
            if bm * bn * bk > 32768 or bk > 2 * k: continue
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
            try:
                t = bench(lambda: gemv_triton(x, w, config=cfg, num_warps=nw), reps=20)
            except Exception as e:
                continue
            res.append((t, bn, bk, nw))
        res.sort()
        t, bn, bk, nw = res[0]
        print(f"M={M} {name:8s} cuBLAS {tc*1e6:7.1f}us {gb/tc:6.0f}GB/s | default {gemv_config(M, n, k)} {td*1e6:7.1f}us {gb/td:6.0f}GB/s "
              f"| best BN={bn} BK={bk} warps={nw} {t*1e6:7.1f}us {gb/t:6.0f}GB/s | next: " +
              ", ".join(f"{b}/{kk}/{w_} {tt*1e6:.1f}" for tt, b, kk, w_ in res[1:4]), flush=True)
