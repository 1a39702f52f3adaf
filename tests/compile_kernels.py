"""Compile every Triton kernel ahead of time for Hopper (sm_90) without a GPU, with programmatic
dependent launch on (the interpreter runs them with it off); prints 'ok' per kernel. Used by
tests/test_kernels.py (in a subprocess, outside Triton's interpreter). The kernels compile in
a process each core, up to 8 (from a cold Triton cache on 2 cores: 319 s in one, 152 in two)."""
import os
import sys
from concurrent.futures import ProcessPoolExecutor

from picovllm.kernels import (
    decode_attention,
    fp8_gemm,
    gemm,
    gemv,
    kv_store,
    penalties,
    prefill_attention,
    rms_norm,
    sampling,
    silu_mul,
)
from picovllm.kernels.triton_utils import triton


def compile_sm90(fn, pointers: dict, constexprs: dict, floats=("scale", "eps", "k_inv", "v_inv"), divisible=(),
                 num_warps: int = 4, num_stages: int = 3):
    """Compile a kernel ahead of time for Hopper (sm_90), no GPU needed (here, and
    benchmarks/kernels/kernel_sass.py). pointers: argument name -> Triton pointer type ("*bf16"); every
    other argument not in constexprs is an i32 (fp32 if in floats); those in divisible are
    declared multiples of 16, as Triton specialises them at launch."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "fp32" if name in floats else "i32")
                 for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if (name in divisible or name in pointers) and name not in constexprs}
    constants = {(i,): constexprs[name] for i, name in enumerate(fn.arg_names) if name in constexprs}
    return triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def kernels(dt: str) -> list[tuple]:
    """(kernel, constexprs, pointer types) of every kernel to compile, at dtype dt."""
    p = f"*{dt}"
    ptrs = {n: p for n in ("q", "k", "v", "q_out", "k_cache", "v_cache", "out", "x", "weight", "gate_up", "cos", "sin",
                            "bias", "norm_weight", "residual", "k_new", "v_new")}
    ptrs.update(block_tables="*i64", context_lens="*i64", query_start_loc="*i64", slot_mapping="*i64",
                part_acc="*fp32", part_m="*fp32", part_l="*fp32", part_ml="*fp32", work="*i64", weight_scale="*fp32")
    fp8 = {"weight": "*fp8e4nv"}  # (an FP8 weight's kernels: HAS_SCALE)
    fp8_cache = {n: "*fp8e4nv" for n in ("k_cache", "v_cache", "k_new", "v_new")}  # (kv_cache_dtype="fp8")
    sampler = {"logits": "*fp32", "values": "*fp32", "temperature": "*fp32", "top_k": "*i64", "top_p": "*fp32",
               "min_p": "*fp32", "counts": "*i32", "thresholds": "*fp32", "seeds": "*i64", "keys": "*i64",
               "greedy": "*i1", "bitmask": "*i32"}
    precision = "ieee" if dt == "fp32" else "tf32"
    entries = [  # (an entry's third element, if any: pointer types of its own)
        *[(prefill_attention._prefill_kernel, dict(BLOCK_SIZE=16, HEAD_DIM=128, BLOCK_M=64, BLOCK_N=64, BLOCK_D=128,
                                                   PRECISION=precision, SPLITS=splits, MIN_PART=128, NEW_KV=new_kv),
           fp8_cache if splits == 16 else {})
          for splits, new_kv in ((1, False), (1, True), (16, True))],
        (prefill_attention._prefill_merge_kernel,
         dict(HEAD_DIM=128, BLOCK_M=64, BLOCK_N=64, BLOCK_D=128, SPLITS=16, MIN_PART=128, MERGE_ROWS=16)),
        *[(decode_attention._decode_partition_kernel,
           dict(BLOCK_SIZE=16, HEAD_DIM=128, SPLITS=splits, BLOCK_N=32, BLOCK_G=16, BLOCK_D=128, PRECISION=precision,
                MIXED=mixed), fp8_cache if mixed else {})
          for splits in (1, 16) for mixed in (False, True)],
        *[(decode_attention._decode_merge_kernel, dict(HEAD_DIM=128, SPLITS=16, BLOCK_N=32, BLOCK_D=128, MIXED=mixed))
          for mixed in (False, True)],
        *[(kv_store._rope_store_kernel, dict(BLOCK_SIZE=16, BLOCK_H=16, BLOCK_KH=2, BLOCK_D=64, NEW_KV=new_kv), cache)
          for cache, new_kv in (({}, False), ({}, True), (fp8_cache, True))],
        (rms_norm._rms_norm_kernel, dict(BLOCK=2048)),
        (silu_mul._silu_mul_kernel, dict(BLOCK=1024)),
        *[(gemv._gemv_kernel, dict(HAS_BIAS=True, HAS_NORM=True, HAS_RESIDUAL=True, SILU_MUL=True, HAS_SCALE=scale,
                                   BLOCK_M=8, BLOCK_N=4, BLOCK_K=256, ONE_TILE=one_tile), fp8 if scale else {})
          for one_tile in (False, True) for scale in (False, True)],
        *[(gemv._qkv_rope_store_kernel, dict(HALF=64, BLOCK_SIZE=16, HAS_BIAS=True, HAS_SCALE=scale, BLOCK_M=1,
                                             BLOCK_N=2, BLOCK_K=2048, ONE_TILE=one_tile),
           {**fp8, **fp8_cache} if scale else {})
          for one_tile in (False, True) for scale in (False, True)],
        *[(fp8_gemm._per_token_fp8_kernel, dict(HAS_NORM=norm, SILU_MUL=silu, BLOCK_K=2048),
           {"out": "*fp8e4nv", "scale": "*fp32", "norm_weight": p})
          for norm, silu in ((False, False), (True, False), (False, True))],
        *[(gemm._gemm_kernel, dict(HAS_SCALE=True, HAS_BIAS=True, HAS_RESIDUAL=True, SILU_MUL=False, SPLIT=split,
                                   TMA=tma, BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=128,
                                   **({} if tma else {"a_desc": None, "w_desc": None})),
           {"weight": "*fp8e4nv", "a": "*fp8e4nv", "a_scale": "*fp32", "partial": "*fp32", "arrivals": "*i32",
            "a_desc": f"tensordesc<fp8e4nv[{block_m},128]>", "w_desc": "tensordesc<fp8e4nv[32,128]>"})
          for block_m, tma in ((16, False), (64, False), (128, True)) for split in (False, True)],  # (64: wgmma)
        *[(gemm._gemm_kernel, dict(HAS_SCALE=False, HAS_BIAS=True, HAS_RESIDUAL=not silu, SILU_MUL=silu,
                                   SPLIT=split, TMA=False, BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=128, a_desc=None,
                                   w_desc=None),
           {"a": p, "a_scale": p, "weight_scale": p, "partial": "*fp32", "arrivals": "*i32"})
          for block_m in (16, 64) for split, silu in ((False, False), (True, False), (False, True))],
        # (a bf16 or fp16 model's: kernels/gemm.py's streams, gate_up with SiLU*mul)
        (sampling._count_kernel, dict(CHUNK=2048), sampler),
        (sampling._threshold_kernel, dict(TILE=1024, CHUNKS=128), sampler),
        (sampling._race_kernel, dict(CHUNK=2048), sampler),
        (sampling._masked_fp32_kernel, dict(BLOCK=2048), {"logits": p, "bitmask": "*i32", "out": "*fp32"}),
        (penalties._penalty_kernel, dict(TILE=512), {"logits": "*fp32", "seen_logits": "*fp32", "prompt_ids": "*i64",
                                                     "output_ids": "*i64", "ordered": "*i64", "repetition": "*fp32",
                                                     "frequency": "*fp32", "presence": "*fp32"}),
    ]
    return [(fn, constexprs, {**ptrs, **dict(*own)}) for fn, constexprs, *own in entries]


def compile_one(dt: str, i: int) -> str:
    """Kernel i of kernels(dt) with programmatic dependent launch (the default on sm_90): its wait
    compiled in; its 'ok' line, with any 64-bit division found in its PTX."""
    fn, constexprs, pointers = kernels(dt)[i]
    ptx = compile_sm90(fn, pointers, {**constexprs, "USE_PDL": True}).asm["ptx"]
    assert "griddepcontrol.wait" in ptx
    divisions = [op for op in ("div.s64", "rem.s64", "div.u64", "rem.u64") if op in ptx]
    return " ".join(["ok", fn.__name__, *divisions])


def main(dt: str) -> None:
    n = len(kernels(dt))
    with ProcessPoolExecutor(min(len(os.sched_getaffinity(0)), 8)) as pool:  # (each holds torch and Triton)
        for line in pool.map(compile_one, [dt] * n, range(n)):
            print(line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
