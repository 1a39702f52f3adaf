"""Linear layers written for tensor parallelism (Megatron split); tp_size=1 is a plain linear.

Each parameter has a ``weight_loader(param, loaded, shard_id=None)`` that copies the part of
a checkpoint tensor that belongs to this rank (and, for fused layers, to this shard).

A layer may take its neighbours with it: the RMSNorm of its input (``norm``), SiLU*mul of a fused
gate_up output, and the residual add of its output. At decode batch 1 on the GPU all of it
is one GEMV kernel (kernels/gemv.py), but for a deep or wide FP8 weight (the down projection, a
fused gate_up), which the GEMM below reads faster, its row quantized first (one_row_gemm);
otherwise the ops run one after the other, the GEMM at 2-64 tokens on Hopper the
weight-streaming one of kernels/gemm.py (the bias and the residual or SiLU*mul in its epilogue),
else cuBLAS's. An FP8 weight (model/layers/fp8.py) at more rows goes through kernels/fp8_gemm.py's
fp8_linear, the bias and residual in its GEMM's epilogue. On a CPU, bf16 and fp16 weights are
packed for oneDNN's GEMM where it has one for their dtype, and fp32 weights past a size
(pack_weights); where it has none, a bf16 or fp16 weight at 16 rows or more is multiplied in fp32
(upcast_linear).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from picovllm.config import check_tp_heads
from picovllm.distributed.communicator import tp_all_reduce
from picovllm.distributed.parallel_state import get_tp_rank, get_tp_size
from picovllm.kernels.fp8_gemm import fp8_linear
from picovllm.kernels.gemm import deep, gemm_triton, streams, wide
from picovllm.kernels.gemv import gemv_triton
from picovllm.kernels.silu_mul import silu_mul as silu_mul_op
from picovllm.kernels.triton_utils import use_triton


def one_row_on_gpu(x: torch.Tensor) -> bool:
    """Whether x is one row on the Triton path: decode at batch 1, where the layers run as GEMVs with
    their neighbours fused in (kernels/gemv.py)."""
    return use_triton(x) and x.dim() == 2 and x.shape[0] == 1


def one_row_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None) -> bool:
    """Whether one row on the Triton path takes the GEMM, its row quantized first, not the GEMV: a
    deep or wide FP8 weight (kernels/gemm.py's deep and wide), which the GEMM reads faster."""
    return one_row_on_gpu(x) and weight_scale is not None and (deep(*weight.shape) or wide(*weight.shape))


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    weight_scale: torch.Tensor | None = None,
    norm: nn.Module | None = None,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
    silu_mul_input: bool = False,
) -> torch.Tensor:
    """residual + act(norm(x) @ weight.T + bias), where act is SiLU*mul of the two output halves
    when silu_mul is set; silu_mul_input: x is a gate_up output, SiLU*mul of its halves first (an
    FP8 weight past one row does it in the kernel that quantizes x); weight_scale: an FP8 weight's
    scale per row (model/layers/fp8.py).
    residual may be updated in place and returned (callers pass the residual stream, whose old
    value they do not read again): the GEMM then adds into it, where a new output first took a
    copy of it (a device-to-device copy per call, two per layer)."""
    gemv = one_row_on_gpu(x) and not one_row_gemm(x, weight, weight_scale)
    if silu_mul_input and (weight_scale is None or gemv):
        x, silu_mul_input = silu_mul_op(x), False
    if gemv:
        return gemv_triton(
            x,
            weight,
            bias,
            norm.weight if norm is not None else None,
            norm.eps if norm is not None else 0.0,
            residual,
            silu_mul,
            weight_scale=weight_scale,
        )
    if weight_scale is not None:  # FP8, the activations normed and quantized per token (kernels/fp8_gemm.py)
        normed = (norm.weight, norm.eps) if norm is not None else (None, 0.0)
        if not silu_mul:
            return fp8_linear(x, weight, weight_scale, bias, residual, *normed, silu_mul_input)
        y = silu_mul_op(fp8_linear(x, weight, weight_scale, bias, None, *normed, silu_mul_input))
        return y if residual is None else residual.add_(y)
    if norm is not None:
        x = norm(x)
    if streams(x, weight):  # (2-64 tokens on Hopper: kernels/gemm.py, bias, residual or SiLU*mul in its epilogue)
        if not silu_mul:
            return gemm_triton(x, weight, bias, residual, x.dtype)
        y = gemm_triton(x, weight, bias, None, x.dtype, silu_mul=True)
        return y if residual is None else residual.add_(y)
    if weight.is_mkldnn:  # (oneDNN's own layout on a CPU: pack_weights)
        y = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    elif upcasts(x, weight):  # (a CPU without a GEMM for the weight's dtype, at 16 rows or more)
        y = upcast_linear(x, weight, bias)
    elif residual is not None and bias is None and not silu_mul and x.dim() == 2:
        return residual.addmm_(x, weight.t())  # the add in the GEMM's epilogue: no kernel of its own
    else:
        y = F.linear(x, weight, bias)
    if silu_mul:
        y = silu_mul_op(y)
    return y if residual is None else residual.add_(y)


def cpu_gemm(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN has a GEMM for dtype, bf16 or fp16, as torch reports (without one,
    torch multiplies in that dtype at a fifth of its fp32 speed or less: benchmarks/README.md's CPU
    section)."""
    supported = {
        torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
        torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported,
    }.get(dtype)
    return torch.backends.mkldnn.is_available() and supported is not None and supported()


def pack_weights(model: nn.Module) -> int:
    """On a CPU, the linear layers' weights (the LM head's included) in oneDNN's blocked layout,
    which linear() hands to oneDNN's own linear: the GEMM PyTorch's F.linear runs for bf16 and fp16,
    without re-reading the weight in the layout it was loaded in (Inductor packs CPU weights the
    same way). bf16 and fp16 weights where oneDNN has a GEMM for their dtype (as torch reports),
    each weight; fp32 weights of at least PACK_MIN_FP32 elements (F.linear's fp32 GEMM, MKL's, ran
    decode's few rows at half oneDNN's rate or less on an AMD CPU: benchmarks/README.md's CPU
    section; below that size oneDNN's call costs more than it saves). A packed weight takes the
    place of the plain one (a tied LM head keeps the embedding's). Returns how many weights were
    packed (0: none, the plain path). FP8 weights stay as they are."""
    dtype = next(model.parameters()).dtype
    if cpu_gemm(dtype):
        rows, least = 1, 0  # (rows: the batch oneDNN lays the weight out for)
    elif dtype == torch.float32 and torch.backends.mkldnn.is_available():
        rows, least = PACK_ROWS_FP32, PACK_MIN_FP32
    else:
        return 0
    from picovllm.model.layers.embedding import ParallelLMHead

    layers = [
        m
        for m in model.modules()
        if isinstance(m, LinearBase | ParallelLMHead) and m.weight.dtype == dtype and m.weight.numel() >= least
    ]
    for m in layers:
        m.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), rows), requires_grad=False)
    return len(layers)


PACK_MIN_FP32 = 1 << 19  # (elements: a 768 x 768 weight, about where oneDNN's packed GEMM starts to pay)
PACK_ROWS_FP32 = 16  # (the layout's batch: at one row within 15% of a one-row layout, at 2-8 rows twice as fast)


UPCAST_ROWS = 16  # (the fewest rows upcast_linear takes: below, the weight's dtype is faster, reading half the bytes)


def upcasts(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x @ weight.T runs in fp32 (upcast_linear): a bf16 or fp16 weight on a CPU, at
    UPCAST_ROWS rows or more. (linear() asks only of a weight pack_weights left plain: oneDNN has
    no GEMM for its dtype.)"""
    return (
        x.device.type == "cpu"
        and weight.dtype in (torch.bfloat16, torch.float16)
        and x.numel() >= UPCAST_ROWS * x.shape[-1]
    )


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int = 256) -> torch.Tensor:
    """x @ weight.T + bias in fp32, rounded to x's dtype: the weight converted rows at a time into a
    buffer that stays in the CPU's cache, each slice's product into the output. Without a bf16
    (fp16) GEMM, torch's in those dtypes runs at a fifth of its fp32 speed or less on a prompt's
    rows (benchmarks/README.md's CPU section); the products are the same, summed in another order."""
    x32 = x.reshape(-1, x.shape[-1]).float()
    n = weight.shape[0]
    out = torch.empty(x32.shape[0], n, dtype=x.dtype)
    w32, part = torch.empty(rows, weight.shape[1]), torch.empty(x32.shape[0], rows)
    for i in range(0, n, rows):
        j = min(i + rows, n)
        w, p = w32[: j - i].copy_(weight[i:j]), part if j - i == rows else torch.empty(x32.shape[0], j - i)
        if bias is None:
            torch.mm(x32, w.t(), out=p)
        else:
            torch.addmm(bias[i:j].float(), x32, w.t(), out=p)
        out[:, i:j] = p
    return out.reshape(*x.shape[:-1], n)


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: checkpoint has {tuple(loaded.shape)}, model expects {tuple(param.shape)}")
    param.copy_(loaded)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """For parameters that are neither split nor fused (norms)."""
    _copy_checked(param.data, loaded)


class LinearBase(nn.Module):
    """Holds weight (out, in) and optional bias; ``tp_dim`` is the split dimension (None: replicated)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.tp_rank, self.tp_size, self.tp_dim = get_tp_rank(), get_tp_size(), tp_dim
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.register_parameter("weight_scale", None)  # (an FP8 weight's: model/layers/fp8.py)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if self.tp_dim is not None and self.tp_size > 1 and loaded.dim() > self.tp_dim:
            loaded = loaded.chunk(self.tp_size, self.tp_dim)[self.tp_rank]
        _copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        return linear(x, self.weight, self.bias, weight_scale=self.weight_scale, norm=norm)

    def checkpoint_rows(self, shard_id=None) -> int:
        """Rows of the checkpoint tensor (all ranks' rows) that weight_loader takes this shard from."""
        return self.weight.shape[0] * (self.tp_size if self.tp_dim == 0 else 1)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        tp = get_tp_size()
        if out_features % tp:
            raise ValueError(f"output size {out_features} is not divisible by tp_size {tp}")
        super().__init__(in_features, out_features // tp, bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one GEMM (e.g. gate and up projections)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        shard = loaded.chunk(self.tp_size, 0)[self.tp_rank]
        _copy_checked(param.data.narrow(0, offset, size), shard)

    def checkpoint_rows(self, shard_id=0) -> int:
        return self.output_sizes[shard_id]

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None, silu_mul: bool = False) -> torch.Tensor:
        """silu_mul: SiLU of the first output half times the second (gate and up projections)."""
        return linear(x, self.weight, self.bias, weight_scale=self.weight_scale, norm=norm, silu_mul=silu_mul)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused; each rank holds its own query heads and the KV heads they
    read. With more ranks than KV heads, each KV head is replicated on tp_size / num_kv_heads
    ranks (rank r holds KV head r // replicas, which its query heads belong to)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = get_tp_size()
        check_tp_heads(num_heads, num_kv_heads, tp)
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads = num_heads // tp, max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        local = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, local * tp, bias)
        self.first_kv_head = self.tp_rank // self.kv_replicas * self.num_kv_heads  # (of the model's)
        self.total_kv_heads = num_kv_heads

    def checkpoint_rows(self, shard_id="q") -> int:
        return (self.num_heads * self.tp_size if shard_id == "q" else self.total_kv_heads) * self.head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str = "q") -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        if shard_id == "q":
            shard = loaded.narrow(0, self.tp_rank * q_size, q_size)
        else:  # this rank's KV heads: its own slice, or (replicated) the one head its queries read
            shard = loaded.narrow(0, self.first_kv_head * self.head_dim, kv_size)
        _copy_checked(param.data.narrow(0, offset, size), shard)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        tp = get_tp_size()
        if in_features % tp:
            raise ValueError(f"input size {in_features} is not divisible by tp_size {tp}")
        super().__init__(in_features // tp, out_features, bias, tp_dim=1)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, silu_mul_input: bool = False
    ) -> torch.Tensor:
        """residual + x @ weight.T (+ bias), residual updated in place (see linear); partial sums
        are reduced before the residual add. silu_mul_input: see linear."""
        bias = self.bias if self.tp_rank == 0 else None
        w, scale = self.weight, self.weight_scale
        if self.tp_size == 1:
            return linear(x, w, bias, weight_scale=scale, residual=residual, silu_mul_input=silu_mul_input)
        y = tp_all_reduce(linear(x, w, bias, weight_scale=scale, silu_mul_input=silu_mul_input))
        return y if residual is None else residual.add_(y)
