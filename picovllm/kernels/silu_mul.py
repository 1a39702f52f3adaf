"""SwiGLU activation on a fused gate_up output: silu(gate) * up."""
import torch
import torch.nn.functional as F

from picovllm.kernels.triton_utils import pdl, pdl_wait, tl, triton, use_triton


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def silu_mul_values(g, u, dt: tl.constexpr):
    """silu(g) * u in dt (g, u in fp32), rounded as silu_mul_ref rounds it: F.silu's output to dt,
    then the product to dt (also the GEMV's with the gate_up weight fused, kernels/gemv.py, and the FP8
    layers' quantizing kernel's, kernels/fp8_gemm.py)."""
    act = (g / (1.0 + tl.exp(-g))).to(dt)
    return (act.to(tl.float32) * u).to(dt)


@triton.jit
def _silu_mul_kernel(gate_up, out, s_r, s_c, s_or, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    pdl_wait(USE_PDL)
    g = tl.load(gate_up + row * s_r + cols * s_c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up + row * s_r + (cols + n) * s_c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * s_or + cols, silu_mul_values(g, u, out.dtype.element_ty), mask=mask)


def silu_mul_triton(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    rows = gate_up.reshape(-1, gate_up.shape[-1]) if gate_up.dim() != 2 else gate_up
    n = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](rows, out, rows.stride(0), rows.stride(1),
                                                             out.stride(0), n, BLOCK=block, **pdl(gate_up))
    return out.view(*gate_up.shape[:-1], n)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return (silu_mul_triton if use_triton(gate_up) else silu_mul_ref)(gate_up)
