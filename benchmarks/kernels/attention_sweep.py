"""The prefill attention kernel (kernels/prefill_attention.py) on Qwen2.5-1.5B's attention shapes
(12 query heads, 2 KV heads, head_dim 128, block size 16, bf16) over a sweep of tiles and launch
options; each timing is 20 calls replayed from a CUDA graph (GPU only). Cases: the cold prefill of
`picovllm bench prefix` scenario b (2,123 tokens), its warm hit (40 new tokens over 2,083 cached),
and a serving chunk (448 tokens over 64 cached). "reversed": the work list longest-first; "new_kv":
the step's own keys and values read laid end to end, as the engine runs it on a GPU (the cached
prefix's through the block table; the rest of the sweep reads every key through the table). The
warm hit and a late chunk of a 512-token prompt at a 128-token step budget (103 tokens over 409
cached, as `profile_decode.py serve 128 64` sees them) also over key splits (num_splits() gives
both 16 in a graph; each split at least 2 key tiles).

Usage: PYTHONPATH=. python benchmarks/kernels/attention_sweep.py
       PYTHONPATH=. python benchmarks/kernels/attention_sweep.py splits
         the key-split sweep alone (BLOCK_N 32 / 64 / 128), for the warm hit and the late chunk
       PYTHONPATH=. python benchmarks/kernels/attention_sweep.py decode
         the decode kernel (kernels/decode_attention.py) as a mixed-step graph of 128 tokens runs it:
         64 decodes over 560-623 keys beside a 64-token prompt chunk, 128 sequence slots, over the
         splits and the fewest keys per split; and as a decode step of the same 64 runs it.
       PYTHONPATH=. python benchmarks/kernels/attention_sweep.py decode_kv [BATCH ...]
         the decode kernel at large batches (default 128 and 256; one split from 256) over 1,024-token
         contexts, a bf16 and an FP8 (e4m3) cache laid as the engine's pool, each sequence's blocks
         in order as a batch prefilled together holds them (blocks in random order made other tiles
         look faster than they are in a step: benchmarks/README.md's rejected table), over key
         tiles, warps and stages: us a call and the share of copy bandwidth of the cache's bytes.
       PYTHONPATH=. python benchmarks/kernels/attention_sweep.py decode_kv_once BATCH
         the same inputs, the engine's tiles, each cache's kernel twice: for a profiler
         (`gpu_check.sh ncu`)."""

import itertools
import sys

import torch

from benchmarks.kernels.gemv_sweep import bench
from picovllm.bench.common import copy_bandwidth
from picovllm.kernels.decode_attention import BLOCK_N, NUM_STAGES, NUM_WARPS, decode_attention_triton, num_splits
from picovllm.kernels.prefill_attention import prefill_attention_triton, prefill_work
from picovllm.model.layers.fp8 import FP8
from picovllm.worker.model_runner import allocate_kv_pool

HEADS, KV_HEADS, DIM, BLOCK_SIZE = 12, 2, 128, 16
CASES = {"cold 2123": (2123, 0), "warm 40/2083": (40, 2083), "chunk 448/64": (448, 64), "chunk 103/409": (103, 409)}
DEFAULT = (64, 64, 4, 3)  # BLOCK_M, BLOCK_N, warps, stages


def inputs(new: int, cached: int):
    ctx = new + cached
    blocks = -(-ctx // BLOCK_SIZE)
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    k_cache = torch.randn(blocks + 5, BLOCK_SIZE, KV_HEADS, DIM, **bf16)
    v_cache = torch.randn(blocks + 5, BLOCK_SIZE, KV_HEADS, DIM, **bf16)
    tables = torch.randperm(blocks + 5, device="cuda")[:blocks].view(1, -1).to(torch.int32)
    query = torch.randn(new, HEADS, DIM, **bf16)
    return query, k_cache, v_cache, tables, torch.tensor([ctx], device="cuda"), torch.tensor([0, new], device="cuda")


def main(only_splits: bool = False) -> None:
    for name, (new, cached) in CASES.items():
        if only_splits and cached <= 3 * new:
            continue
        query, kc, vc, tables, ctx, qsl = inputs(new, cached)
        flops = 4 * HEADS * DIM * sum(cached + i + 1 for i in range(new))

        pos = torch.arange(cached, cached + new, device="cuda")  # the step's keys and values, laid end to end
        blocks, offsets = tables[0, pos // BLOCK_SIZE].long(), pos % BLOCK_SIZE
        laid = (kc[blocks, offsets].contiguous(), vc[blocks, offsets].contiguous())

        def time(bm, bn, warps, stages, reverse=False, splits=None, new_kv=False):
            work = torch.from_numpy(prefill_work([new], bm)[:: -1 if reverse else 1].copy()).cuda()
            return bench(
                lambda: prefill_attention_triton(
                    query,
                    kc,
                    vc,
                    tables,
                    ctx,
                    qsl,
                    DIM**-0.5,
                    new,
                    block_m=bm,
                    block_n=bn,
                    work=work,
                    num_warps=warps,
                    num_stages=stages,
                    splits=splits,
                    new_kv=laid if new_kv else None,
                ),
                reps=20,
            )

        results = []
        for cfg in [] if only_splits else itertools.product((64, 128), (32, 64), (4, 8), (2, 3)):
            try:
                results.append((time(*cfg), cfg, False))
            except Exception:  # out of registers or shared memory
                continue
        results.sort()
        results += [] if only_splits else [(time(*results[0][1], reverse=True), results[0][1], True)]
        shown = [(*r, False) for r in results[:3] + [r for r in results if r[1] == DEFAULT] + results[-1:]]
        for cfg in [] if only_splits else [results[0][1], DEFAULT]:
            shown.append((time(*cfg, new_kv=True), cfg, False, True))
        for t, cfg, reverse, new_kv in shown:
            print(
                f"{name:13s} BLOCK_M={cfg[0]:3d} BLOCK_N={cfg[1]:3d} warps={cfg[2]} stages={cfg[3]}"
                f"{' reversed' if reverse else '':9s}{' new_kv' if new_kv else '':7s}: {t * 1e6:7.1f} us "
                f"{flops / t / 1e12:6.1f} TFLOP/s",
                flush=True,
            )
        if cached > 3 * new:  # few queries over a long prefix: other key splits than num_splits() gives
            for bn, splits in itertools.product((32, 64, 128), (1, 2, 4, 8, 16, 32, 64)):
                try:
                    t = time(64, bn, 4, 2, splits=splits)
                except Exception as e:  # (a sweep goes on)
                    print(f"{name:13s} BLOCK_N={bn:3d} splits={splits:2d}: {type(e).__name__}: {e}", flush=True)
                    continue
                print(
                    f"{name:13s} BLOCK_M= 64 BLOCK_N={bn:3d} warps=4 stages=2 splits={splits:2d}: {t * 1e6:7.1f} us",
                    flush=True,
                )


def decode(decodes: int = 64, chunk: int = 64, slots: int = 128) -> None:
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    ctx = torch.zeros(slots, dtype=torch.int64, device="cuda")
    ctx[:decodes] = torch.arange(560, 560 + decodes, device="cuda")
    ctx[decodes] = chunk  # the prompt chunk's sequence (the prefill kernel's)
    width = -(-int(ctx.max()) // BLOCK_SIZE)
    num_blocks = (decodes + 1) * width
    tables = torch.randperm(num_blocks, device="cuda").view(decodes + 1, width)
    tables = torch.cat([tables, torch.zeros(slots - decodes - 1, width, dtype=tables.dtype, device="cuda")])
    kc = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, DIM, **bf16)
    vc = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, DIM, **bf16)
    tokens = decodes + chunk
    qsl = torch.full((slots + 1,), tokens, dtype=torch.int64, device="cuda")
    qsl[: decodes + 1] = torch.arange(decodes + 1, device="cuda")
    query, out = torch.randn(tokens, HEADS, DIM, **bf16), torch.empty(tokens, HEADS, DIM, **bf16)
    scale = DIM**-0.5
    for splits in (1, 2, 4, 8):  # (a decode step takes num_splits(); one split needs no merge kernel)
        t = bench(
            lambda: decode_attention_triton(query[:decodes], kc, vc, tables[:decodes], ctx[:decodes], scale, splits),
            reps=20,
        )
        print(
            f"decode step, {decodes} sequences, {splits} splits"
            f"{' (the default)' if splits == num_splits(decodes, KV_HEADS) else ''}: {t * 1e6:6.1f} us",
            flush=True,
        )
    for splits, min_keys in itertools.product((2, 4, 8, 16), (32, 64, 128, 192, 256, 320, 512)):
        t = bench(
            lambda: decode_attention_triton(
                query, kc, vc, tables, ctx, scale, splits, query_start_loc=qsl, out=out, min_keys=min_keys
            ),
            reps=20,
        )
        print(
            f"mixed step, {decodes} decodes in {slots} slots, {splits:2d} splits of at least {min_keys:3d} keys: "
            f"{t * 1e6:6.1f} us",
            flush=True,
        )


def decode_kv_inputs(batch: int, dtype: torch.dtype, context: int):
    """A decode step's attention inputs over a KV pool laid as the engine lays it
    (allocate_kv_pool), each sequence's blocks in order: query, k_cache, v_cache, tables, contexts."""
    width = context // BLOCK_SIZE
    _, ((kc, vc),) = allocate_kv_pool(1, batch * width, BLOCK_SIZE, KV_HEADS, DIM, dtype, torch.device("cuda"))
    for cache in (kc, vc):
        cache.copy_(torch.randn(cache.shape, device="cuda").to(dtype))
    tables = torch.arange(batch * width, dtype=torch.int32, device="cuda").view(batch, width)
    ctx = torch.full((batch,), context, dtype=torch.int64, device="cuda")
    return torch.randn(batch, HEADS, DIM, dtype=torch.bfloat16, device="cuda"), kc, vc, tables, ctx


def decode_kv_once(batch: int, context: int = 1024) -> None:
    """The engine's decode kernel twice over a bf16 cache, then twice over an FP8 one (for a
    profiler: the second of each is warm)."""
    for dtype in (torch.bfloat16, FP8):
        inputs = decode_kv_inputs(batch, dtype, context)
        for _ in range(2):
            decode_attention_triton(*inputs, DIM**-0.5)
    torch.cuda.synchronize()


def decode_kv(batches: list[int], context: int = 1024) -> None:
    bandwidth = copy_bandwidth(torch.device("cuda"))
    for batch, dtype in itertools.product(batches, (torch.bfloat16, FP8)):
        query, kc, vc, tables, ctx = decode_kv_inputs(batch, dtype, context)
        nbytes = 2 * kc.numel() * kc.element_size()
        expected = decode_attention_triton(query, kc, vc, tables, ctx, DIM**-0.5).float()
        results = []
        for bn, warps, stages in itertools.product((16, 32, 64, 128), (2, 4), (1, 2, 3, 4)):

            def call():
                return decode_attention_triton(
                    query, kc, vc, tables, ctx, DIM**-0.5, block_n=bn, num_warps=warps, num_stages=stages
                )

            try:
                error = ((call().float() - expected).abs().max() / expected.abs().max()).item()
                t = bench(call, reps=20)
            except Exception as e:  # out of registers or shared memory
                print(f"BLOCK_N={bn} warps={warps} stages={stages}: {type(e).__name__}", flush=True)
                continue
            if error > 2e-2:  # (past bf16's rounding, against the largest output)
                print(f"BLOCK_N={bn} warps={warps} stages={stages}: off by {error:.3g} of the largest", flush=True)
                continue
            results.append((t, bn, warps, stages))
        results.sort()
        engines = (BLOCK_N, NUM_WARPS, NUM_STAGES)
        for t, bn, warps, stages in results[:5] + [r for r in results if r[1:] == engines]:
            engine = " (the engine's)" if (bn, warps, stages) == engines else ""
            print(
                f"decode, batch {batch} over {context} keys, {'fp8' if dtype == FP8 else 'bf16':4s} "
                f"BLOCK_N={bn:3d} warps={warps} stages={stages}{engine}: "
                f"{t * 1e6:7.2f} us, {nbytes / t / bandwidth:6.1%} of copy bandwidth",
                flush=True,
            )


if __name__ == "__main__":
    if sys.argv[1:2] == ["decode_kv"]:
        decode_kv([int(a) for a in sys.argv[2:]] or [128, 256])
    elif sys.argv[1:2] == ["decode_kv_once"]:
        decode_kv_once(int(sys.argv[2]))
    else:
        decode() if sys.argv[1:] == ["decode"] else main(only_splits=sys.argv[1:] == ["splits"])
