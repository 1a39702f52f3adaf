"""FP8 linear weights (quantization="fp8", vLLM's name): each linear layer's weight quantized at
load time to float8 e4m3 with one fp32 scale per output channel, weight = fp8 * scale[row].
Embeddings, norms and the LM head stay in the model's dtype, as vLLM keeps them.

A quantized layer holds `weight` in e4m3 and `weight_scale` [out]. Its input is quantized to e4m3
per token (vLLM's W8A8 with dynamic per-token activation scales), and the products' sums scaled
by both scales: on the GPU the GEMV at one row (kernels/gemv.py, the row quantized in registers)
and the FP8 GEMM at more (kernels/fp8_gemm.py), elsewhere its PyTorch reference.

An FP8 checkpoint (config.json's quantization_config with quant_method "fp8", as vLLM and
llm-compressor write it: `weight` in e4m3 and `weight_scale`, one per tensor or one per row)
loads as it is, into layers given FP8 parameters before loading (fp8_parameters).
"""

from __future__ import annotations

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8).float()  # each byte's value in e4m3


def fp8_to_float(x: torch.Tensor) -> torch.Tensor:
    """An e4m3 tensor in fp32. On the CPU its bytes looked up in E4M3_VALUES: torch's cast there
    takes about 4 ns an element, twice the lookup's (the reference GEMM casts every FP8 weight at
    every step)."""
    if x.device.type != "cpu":
        return x.float()
    return E4M3_VALUES.index_select(0, x.reshape(-1).view(torch.uint8).int()).view(x.shape)


def quantize_fp8(weight: torch.Tensor, row_max=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scale per row): each row scaled so that its largest magnitude is e4m3's
    largest, then rounded to nearest; an all-zero row gets a tiny scale and zeros. row_max: what
    makes the rows' largest magnitudes the whole rows' when this is a slice of their columns (a
    row-parallel shard: tp_all_reduce_max)."""
    amax = weight.abs().amax(dim=1).float().clamp(min=torch.finfo(torch.float32).tiny)
    if row_max is not None:
        amax = row_max(amax)
    scale = amax / FP8_MAX
    return (weight.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_linear_weights(model: nn.Module) -> int:
    """Every linear layer's weight (model/layers/linear.py LinearBase: QKV, o, gate_up, down) in
    e4m3 with its per-row scale, in place; returns how many layers. Under tensor parallelism the
    scales are those of the whole rows (a row-parallel layer's ranks agree on each row's largest
    magnitude), so that every rank holds its slice of what one rank would: the same model at any
    tensor-parallel size."""
    from picovllm.distributed.communicator import tp_all_reduce_max
    from picovllm.model.layers.linear import LinearBase

    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    for m in layers:
        q, scale = quantize_fp8(m.weight.detach(), tp_all_reduce_max if m.tp_dim == 1 else None)
        m.weight = nn.Parameter(q, requires_grad=False)
        m.weight_scale = nn.Parameter(scale, requires_grad=False)
    return len(layers)


def fp8_parameters(model: nn.Module) -> None:
    """Every linear layer with an e4m3 weight and an fp32 scale per row, empty, for an FP8
    checkpoint to load into: each takes its rows as the layer's weight loader gives them (fused
    shards, tensor-parallel slices). A checkpoint's scale of one per tensor is its rows' scale."""
    from picovllm.model.layers.linear import LinearBase

    for m in model.modules():
        if not isinstance(m, LinearBase):
            continue
        m.weight = nn.Parameter(torch.empty(m.weight.shape, dtype=FP8, device=m.weight.device), requires_grad=False)
        m.weight.weight_loader = m.weight_loader
        scale = torch.empty(m.weight.shape[0], dtype=torch.float32, device=m.weight.device)
        m.weight_scale = nn.Parameter(scale, requires_grad=False)
        m.weight_scale.weight_loader = _scale_loader(m)


def _scale_loader(layer):
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        loaded = loaded.float().reshape(-1)  # (per row: [rows] or [rows, 1])
        if loaded.numel() == 1:  # one per tensor: every row of it
            loaded = loaded.expand(layer.checkpoint_rows(shard_id))
        if shard_id is None:
            layer.weight_loader(param, loaded)
        else:
            layer.weight_loader(param, loaded, shard_id)

    return load
