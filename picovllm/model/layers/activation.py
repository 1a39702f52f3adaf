from torch import nn
import torch

from picovllm.kernels.silu_mul import silu_mul


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up)
