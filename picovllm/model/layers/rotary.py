"""Rotary embedding's cos/sin table (fp32 math, stored in the model dtype); the rotation itself is
fused with the KV-cache store (kernels/kv_store.py)."""

from __future__ import annotations

import math

import torch
from torch import nn


def _inv_freq(head_dim: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_scaling is None:
        return inv_freq
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind == "linear":
        return inv_freq / rope_scaling["factor"]
    if kind == "llama3":
        factor = rope_scaling["factor"]
        low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
        old_len = rope_scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None):
        super().__init__()
        inv_freq = _inv_freq(head_dim, base, rope_scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        dtype = torch.get_default_dtype()
        self.register_buffer("cos", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, [num_tokens, head_dim // 2]; computed once per forward."""
        return self.cos[positions], self.sin[positions]
