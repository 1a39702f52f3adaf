"""SwiGLU activation on a fused gate_up output: silu(gate) * up."""
import torch
import torch.nn.functional as F


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
