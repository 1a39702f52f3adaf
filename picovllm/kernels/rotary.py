"""Rotary position embedding (the rotate-half layout of Hugging Face's Qwen2 and Llama)."""
import torch

from picovllm.kernels.triton_utils import next_pow2, tl, triton, use_triton


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; cos/sin: [num_tokens, head_dim // 2] for each token."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@triton.jit
def _rotary_kernel(x, cos, sin, out, s_xt, s_xh, s_xd, s_ct, s_ot, s_oh, num_heads, half,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_heads) & (d < half)
    c = tl.load(cos + t * s_ct + d, mask=d < half).to(tl.float32)
    s = tl.load(sin + t * s_ct + d, mask=d < half).to(tl.float32)
    x1 = tl.load(x + t * s_xt + h * s_xh + d * s_xd, mask=mask).to(tl.float32)
    x2 = tl.load(x + t * s_xt + h * s_xh + (d + half) * s_xd, mask=mask).to(tl.float32)
    dt = out.dtype.element_ty
    # each product rounded to the model dtype before the sum, as the reference computes it
    o1 = ((x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
    tl.store(out + t * s_ot + h * s_oh + d, o1, mask=mask)
    tl.store(out + t * s_ot + h * s_oh + d + half, o2, mask=mask)


def rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](x, cos, sin, out, *x.stride(), cos.stride(0), out.stride(0), out.stride(1),
                                  num_heads, half, BLOCK_H=next_pow2(num_heads), BLOCK_D=next_pow2(half))
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return (rotary_triton if use_triton(x) else rotary_ref)(x, cos, sin)
