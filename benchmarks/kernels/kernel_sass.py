"""The attention kernels compiled for an H100 / H200 (sm_90) on any machine, no GPU needed: the
SASS instruction count of each kernel and of its loops, and the calls it makes (64-bit integer
division is a call). Shapes: Qwen2.5-1.5B's (12 query heads of 128 over 2 KV heads, block size 16,
bf16); tiles as a warm prefix hit's mixed-step graph runs the prefill kernel (64 queries, 32-key
tiles, 16 splits) and as a batch-1 decode step runs the decode kernel (32 splits of 32 keys), the
latter also over an FP8 (e4m3) cache.

Usage: PYTHONPATH=.:tests python benchmarks/kernels/kernel_sass.py
       PYTHONPATH=.:tests python benchmarks/kernels/kernel_sass.py gemv [BLOCK_N BLOCK_K WARPS]
         a batch-1 step's GEMVs (kernels/gemv.py) at Qwen2.5-1.5B's projections, bf16 and FP8
         weights, at the engine's tiles (or the ones given, for every projection): the instructions
         a thread runs in one program (the loop's body times its trips) per weight element, and the
         registers a thread holds. Where the instructions, not the weight's bytes, set a GEMV's
         time, fewer per element is faster.
       PYTHONPATH=.:tests python benchmarks/kernels/kernel_sass.py fp8_gemm [ROWS ...]
         the FP8 GEMM (kernels/gemm.py) at the engine's tiles (fp8_gemm.py's) for Qwen2.5-1.5B's
         projections at 8, 64, 128, 256 rows (or those given): its K loop's instructions and their
         kinds.
Integer arguments are given as Triton would see them at launch: strides of 1 as constants, the
others divisible by 16 (the block-table row stride is not specialised)."""

import os
import re
import subprocess
import sys

import triton
from compile_kernels import compile_sm90  # tests/compile_kernels.py

from picovllm.kernels import decode_attention, gemv, prefill_attention

ATTENTION_POINTERS = {
    "q": "*bf16",
    "k_cache": "*bf16",
    "v_cache": "*bf16",
    "block_tables": "*i64",
    "context_lens": "*i64",
    "query_start_loc": "*i64",
    "work": "*i64",
    "out": "*bf16",
    "part_acc": "*fp32",
    "part_ml": "*fp32",
    "k_new": "*bf16",
    "v_new": "*bf16",
    "part_m": "*fp32",
    "part_l": "*fp32",
}
UNIT_STRIDES = dict.fromkeys(("s_qd", "c_kd", "c_vd", "s_tw", "s_nd"), 1)  # (constants at launch)
DECODE = dict(
    BLOCK_SIZE=16,
    HEAD_DIM=128,
    SPLITS=32,
    BLOCK_N=32,
    BLOCK_G=16,
    BLOCK_D=128,
    MIN_PART=32,
    PRECISION="tf32",
    MIXED=False,
    USE_PDL=True,
)
FP8_CACHE = {"k_cache": "*fp8e4nv", "v_cache": "*fp8e4nv"}
# name: (kernel, constants, warps, stages (as the engine launches it), pointer types unlike ATTENTION_POINTERS')
KERNELS = {
    "prefill (warm hit, 64 x 32 tiles, 16 splits)": (
        prefill_attention._prefill_kernel,
        dict(
            BLOCK_SIZE=16,
            HEAD_DIM=128,
            BLOCK_M=64,
            BLOCK_N=32,
            BLOCK_D=128,
            PRECISION="tf32",
            SPLITS=16,
            MIN_PART=64,
            USE_PDL=True,
            NEW_KV=True,
        ),
        4,
        2,
        {},
    ),
    "decode (batch 1, 32 splits)": (decode_attention._decode_partition_kernel, DECODE, 4, 3, {}),
    "decode (batch 1, 32 splits), an FP8 cache": (decode_attention._decode_partition_kernel, DECODE, 4, 3, FP8_CACHE),
}


def cubin_tool(kernel, tool: str, *args: str) -> str:
    """What one of Triton's CUDA tools (nvdisasm, cuobjdump) prints for the kernel's cubin."""
    path = f"/tmp/picovllm_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    binary = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    try:
        return subprocess.run([binary, *args, path], capture_output=True, text=True, check=True).stdout
    finally:
        os.remove(path)


def loops(lines: list[tuple[int, str]], labels: dict) -> list[tuple[int, int]]:
    """Each loop's first and last address (a branch back to an earlier label)."""
    return [
        (labels[m.group(1)], address)
        for address, text in lines
        if (m := re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", text)) and labels.get(m.group(1), address) < address
    ]


def loop_bodies(lines: list[tuple[int, str]], labels: dict) -> list[int]:
    """The instruction count of each loop, smallest first."""
    return sorted(sum(start <= a <= end for a, _ in lines) for start, end in loops(lines, labels))


def sass_lines(kernel) -> list[tuple[int, str]]:
    text = cubin_tool(kernel, "nvdisasm", "-c")
    out, labels = [], {}
    for line in text.splitlines():
        if m := re.match(r"^\.(L_x_\d+):", line):
            labels[m.group(1)] = None  # the next instruction's address
        elif m := re.match(r"\s+/\*([0-9a-f]{4})\*/\s+(.*?)\s*;", line):
            address = int(m.group(1), 16)
            for name, at in labels.items():
                if at is None:
                    labels[name] = address
            out.append((address, m.group(2)))
    return out, labels


def main() -> None:
    for name, (fn, constants, warps, stages, pointers) in KERNELS.items():
        divisible = [n for n in fn.arg_names if n not in ("s_tb", "scale", "group")]
        kernel = compile_sm90(
            fn,
            {**ATTENTION_POINTERS, **pointers},
            {**UNIT_STRIDES, **constants},
            divisible=divisible,
            num_warps=warps,
            num_stages=stages,
        )
        lines, labels = sass_lines(kernel)
        bodies = loop_bodies(lines, labels)
        calls = sorted(
            {
                re.sub(r".*\$__internal_\d+_\$__cuda_sm\d+_", "", t).rstrip(")` ")
                for _, t in lines
                if t.startswith("CALL")
            }
        )
        print(
            f"{name}: {len(lines)} SASS instructions, loops of {' / '.join(map(str, bodies))}, shared memory "
            f"{kernel.metadata.shared} B, calls: {', '.join(calls) or 'none'}"
        )


GEMV_PROJECTIONS = {  # name: (output rows, K, norm, SiLU*mul, residual); qkv is the RoPE-and-store kernel
    "qkv": (2048, 1536, True, False, False),
    "o": (1536, 1536, False, False, True),
    "gate_up": (8960, 1536, True, True, False),
    "down": (1536, 8960, False, False, True),
}


def gemv_instructions(tiles: dict | None) -> None:
    activations = ("x", "bias", "norm_weight", "residual", "out", "cos", "sin", "q_out", "k_cache", "v_cache")
    for fp8 in (False, True):
        pointers = dict.fromkeys(activations, "*bf16")
        pointers.update(weight="*fp8e4nv" if fp8 else "*bf16", weight_scale="*fp32", slot_mapping="*i64")
        for name, (n, k, norm, silu, residual) in GEMV_PROJECTIONS.items():
            qkv = name == "qkv"
            cfg = gemv.gemv_config(1, n // 2 if qkv else n, k, norm, silu or qkv, fp8)
            cfg.update(tiles or {})
            warps = cfg.pop("num_warps")
            constants = dict(
                HAS_BIAS=qkv, HAS_SCALE=fp8, ONE_TILE=k <= cfg["BLOCK_K"], USE_PDL=True, s_xk=1, s_wk=1, **cfg
            )
            if qkv:
                constants.update(HALF=64, BLOCK_SIZE=16, c_kd=1, c_vd=1)
            else:
                constants.update(HAS_NORM=norm, HAS_RESIDUAL=residual, SILU_MUL=silu)
            fn = gemv._qkv_rope_store_kernel if qkv else gemv._gemv_kernel
            divisible = [a for a in fn.arg_names if a.startswith(("s_", "c_")) or a in ("K", "N", "up_offset")]
            kernel = compile_sm90(
                fn, pointers, constants, floats=("eps", "k_inv", "v_inv"), divisible=divisible, num_warps=warps
            )
            lines, labels = sass_lines(kernel)
            body = max(loop_bodies(lines, labels), default=0)
            trips = -(-k // cfg["BLOCK_K"])
            executed = len(lines) + (trips - 1) * body
            rows = cfg["BLOCK_N"] * (2 if silu or qkv else 1)
            registers = re.search(r"REG:(\d+)", cubin_tool(kernel, "cuobjdump", "-res-usage")).group(1)
            print(
                f"{'fp8' if fp8 else 'bf16'} {name:8s} {rows} rows x {cfg['BLOCK_K']} on {warps} warps: "
                f"{executed * warps * 32 / (rows * k):5.2f} instructions per weight element "
                f"({len(lines)} SASS, loop {body} x {trips}), {registers} registers"
            )


FP8_GEMM_PROJECTIONS = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}


def fp8_gemm_loops(row_counts: list[int]) -> None:
    """The FP8 GEMM (kernels/gemm.py) at the engine's tiles (fp8_gemm.py's) for each projection and
    row count: its K loop's instructions, the tensor-core ones (QGMMA), the copies to shared memory
    (LDGSTS: a thread's 16-byte copy; UTMALDG: a TMA copy), the fp32 adds of the promotion, and
    what would show the loads not vectorised (LDG, PRMT, STS) or registers spilled (LDL, STL)."""
    from picovllm.kernels import fp8_gemm, gemm

    e4m3, fp32, bf16 = "*fp8e4nv", "*fp32", "*bf16"
    pointers = dict(a=e4m3, weight=e4m3, a_scale=fp32, weight_scale=fp32, partial=fp32, arrivals="*i32")
    pointers.update(bias=bf16, residual=bf16, out=bf16)
    fn = gemm._gemm_kernel
    for name, (n, k) in FP8_GEMM_PROJECTIONS.items():
        for rows in row_counts:
            cfg = fp8_gemm.fp8_gemm_config(rows, n, k)
            warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
            split, tma = cfg.pop("SPLIT_K", 1), cfg.pop("TMA", False)
            constants = dict(HAS_SCALE=True, HAS_BIAS=False, HAS_RESIDUAL=False, SPLIT=split > 1, TMA=tma, USE_PDL=True)
            constants.update(cfg)
            tiles = (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"])
            pointers.update(a_desc=f"tensordesc<fp8e4nv[{tiles[0]},{tiles[2]}]>")
            pointers.update(w_desc=f"tensordesc<fp8e4nv[{tiles[1]},{tiles[2]}]>")
            if not tma:
                constants.update(a_desc=None, w_desc=None)
            divisible = [a for a in fn.arg_names if a not in constants]  # (as Triton sees them at launch)
            kernel = compile_sm90(fn, pointers, constants, divisible=divisible, num_warps=warps, num_stages=stages)
            lines, labels = sass_lines(kernel)
            start, end = max(loops(lines, labels), key=lambda se: sum(se[0] <= a <= se[1] for a, _ in lines))
            opcodes = [t.split()[1 if t.startswith("@") else 0].split(".")[0] for a, t in lines if start <= a <= end]
            shown = ("QGMMA", "LDGSTS", "UTMALDG", "FADD", "LDG", "PRMT", "STS", "LDL", "STL")
            counts = ", ".join(f"{op} {opcodes.count(op)}" for op in shown if op in opcodes)
            how = (f", split {split}" if split > 1 else "") + (", TMA" if tma else "")
            print(
                f"{name:8s} {rows:4d} rows, {' x '.join(map(str, tiles))}{how}: K loop {len(opcodes)} instructions: "
                f"{counts}; shared memory {kernel.metadata.shared} B"
            )


if __name__ == "__main__":
    if sys.argv[1:2] == ["fp8_gemm"]:
        fp8_gemm_loops([int(r) for r in sys.argv[2:]] or [8, 64, 128, 256])
    elif sys.argv[1:2] == ["gemv"]:
        given = sys.argv[2:5]
        gemv_instructions(dict(zip(("BLOCK_N", "BLOCK_K", "num_warps"), map(int, given))) if given else None)
    else:
        main()
