"""Triton is optional: CPU-only installs run the PyTorch references. Kernels are defined against
this module's `triton` and `tl`, which are stand-ins when Triton is missing (never launched then).

On a CPU, tests run the Triton kernels in Triton's interpreter (TRITON_INTERPRET=1, set before
Triton is imported) on CPU tensors."""
from __future__ import annotations

import functools

import torch

from picovllm import envs

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised on installs without Triton
    HAS_TRITON = False

    class _Stub:
        constexpr = object

        @staticmethod
        def jit(fn=None, **kwargs):
            return fn if fn is not None else (lambda f: f)

    triton = tl = _Stub()


ENABLED = not envs.disable_triton()  # tests compare both paths on CUDA
# Tests set this (with TRITON_INTERPRET=1) to run the whole engine's Triton path on CPU tensors.
ON_CPU = False


# Programmatic dependent launch (Hopper and later): each kernel is launched while the one before it
# drains, and does what does not read that one's output (address math, weight loads) before it
# waits (pdl_wait): launch latency and the first weight loads overlap the previous kernel's tail.
# (benchmarks/README.md has what it saves). Off before Hopper;
# tests compare with it off, and the kernel profiler turns it off so that kernel times add up.
PDL = True


@functools.cache
def _hopper_or_later(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def hopper_or_later(x: torch.Tensor) -> bool:
    """Whether x is on a GPU of compute capability 9 or more (programmatic dependent launch, TMA)."""
    return x.is_cuda and _hopper_or_later(x.device.index if x.device.index is not None else 0)


def pdl(x: torch.Tensor) -> dict:
    """The USE_PDL constexpr, and Triton's launch_pdl option, for a kernel on x's device."""
    if PDL and hopper_or_later(x):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait for the previous kernel to finish (its writes visible), then let the next kernel
    launch; nothing without PDL. Before it a kernel writes nothing and reads only what the kernel
    before it does not write (weights; the step's metadata, which the kernels launched before that
    one, or the copies before them, wrote: a kernel starts once the one before it has passed its
    own wait, that is once every earlier kernel has finished)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def use_triton(x: torch.Tensor) -> bool:
    """The Triton path serves CUDA tensors; everything else takes the PyTorch reference."""
    return ENABLED and HAS_TRITON and (x.is_cuda or ON_CPU)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot rounds fp32 operands to TF32 by default on the GPU (1e-3 relative error); fp32 runs
    ask for IEEE fp32 so that they stay a tight check of the bf16 ones."""
    return "ieee" if dtype == torch.float32 else "tf32"
