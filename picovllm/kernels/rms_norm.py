"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32."""
import torch

from picovllm.kernels.triton_utils import next_pow2, pdl, pdl_wait, tl, triton, use_triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


@triton.jit
def rms_norm_row(v, w, n_cols, eps, dt: tl.constexpr):
    """One row's RMSNorm in dt, rounded as rms_norm_ref rounds it: v (fp32, masked lanes zero)
    normed, rounded to dt, times the weight w, rounded to dt (also the FP8 layers' quantizing
    kernel's, kernels/fp8_gemm.py)."""
    normed = (v * (1.0 / tl.sqrt(tl.sum(v * v, axis=0) / n_cols + eps))).to(dt)
    return (w.to(tl.float32) * normed.to(tl.float32)).to(dt)


@triton.jit
def _rms_norm_kernel(x, weight, out, s_xr, s_xc, s_or, n_cols, eps, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(weight + cols, mask=mask)
    pdl_wait(USE_PDL)
    v = tl.load(x + row * s_xr + cols * s_xc, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * s_or + cols, rms_norm_row(v, w, n_cols, eps, out.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), rows.stride(1), out.stride(0),
                                       rows.shape[1], eps, BLOCK=next_pow2(rows.shape[1]), **pdl(x))
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return (rms_norm_triton if use_triton(x) else rms_norm_ref)(x, weight, eps)
