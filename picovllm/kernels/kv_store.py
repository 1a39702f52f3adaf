"""RoPE on a step's queries and keys, fused with writing K and V into the paged cache through
slot_mapping (one launch per layer instead of three). Rotate-half layout, as Hugging Face's
Qwen2 and Llama.

An FP8 cache (kv_cache_dtype="fp8") holds K and V in e4m3, each divided by its layer's scale
(k_scale, v_scale: 1.0, vLLM's default, or the checkpoint's), clamped to e4m3's range and
rounded to nearest even (to_cache, cache_value); the attention kernels read them back in the
queries' dtype, and the layer applies the scales (model/layers/attention.py)."""
import torch

from picovllm.kernels.fp8_gemm import to_fp8, to_fp8_ref
from picovllm.kernels.triton_utils import next_pow2, pdl, pdl_wait, tl, triton, use_triton


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; cos/sin: [num_tokens, head_dim // 2] for each token."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def to_cache(x: torch.Tensor, cache: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x as the cache holds it: in the cache's dtype; for an FP8 cache x / scale in e4m3."""
    if cache.dtype == torch.float8_e4m3fn:
        return to_fp8_ref(x, 1.0 / scale)
    return x.to(cache.dtype)


@triton.jit
def cache_value(x, cache, inv_scale):
    """to_cache in a kernel: x (any float type) as the cache pointer's elements; inv_scale: 1 / the
    FP8 cache's scale."""
    if cache.dtype.element_ty == tl.float8e4nv:
        return to_fp8(x.to(tl.float32), inv_scale)
    return x.to(cache.dtype.element_ty)


def store_kvcache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> None:
    """key/value: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size,
    num_kv_heads, head_dim] (any strides); slot_mapping: [num_tokens], slot = block * block_size +
    offset, -1 marks a padding token whose K/V is not stored."""
    keep = (slot_mapping >= 0).nonzero().squeeze(1)
    slots = slot_mapping[keep]
    block, offset = slots // k_cache.shape[1], slots % k_cache.shape[1]
    k_cache[block, offset] = to_cache(key[keep], k_cache, k_scale)
    v_cache[block, offset] = to_cache(value[keep], v_cache, v_scale)


def rope_and_store_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> torch.Tensor:
    """Rotates q and k, stores the rotated k and v in the cache, returns the rotated q."""
    store_kvcache_ref(rotary_ref(k, cos, sin), v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return rotary_ref(q, cos, sin)


@triton.jit
def rotate_pair(x1, x2, c, s, dt):
    """RoPE of the halves x1, x2 (fp32) by cos c and sin s, in dt; each product rounded to dt
    before the sum, as the reference computes it. (Also the QKV GEMV's epilogue: kernels/gemv.py.)"""
    o1 = ((x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
    return o1, o2


@triton.jit
def _rotate(x, t, h, d, s_xt, s_xh, s_xd, c, s, mask, half):
    """Rotated halves of heads h of token t."""
    x1 = tl.load(x + t * s_xt + h * s_xh + d * s_xd, mask=mask).to(tl.float32)
    x2 = tl.load(x + t * s_xt + h * s_xh + (d + half) * s_xd, mask=mask).to(tl.float32)
    return rotate_pair(x1, x2, c, s, x.dtype.element_ty)


@triton.jit
def _rope_store_kernel(
    q, k, v, cos, sin, q_out, k_cache, v_cache, slot_mapping, k_new, v_new,
    s_qt, s_qh, s_qd, s_kt, s_kh, s_kd, s_vt, s_vh, s_vd, s_ct, s_ot, s_oh,
    c_kb, c_ks, c_kh, c_kd, c_vb, c_vs, c_vh, c_vd,  # cache strides (block, slot, head, dim)
    s_nt, s_nh,  # k_new's and v_new's
    num_heads, num_kv_heads, half, k_inv, v_inv,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr, NEW_KV: tl.constexpr,
):
    t = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)[None, :]
    dmask = d < half
    pdl_wait(USE_PDL)
    c = tl.load(cos + t * s_ct + d, mask=dmask).to(tl.float32)
    s = tl.load(sin + t * s_ct + d, mask=dmask).to(tl.float32)
    h = tl.arange(0, BLOCK_H)[:, None]
    mask = (h < num_heads) & dmask
    o1, o2 = _rotate(q, t, h, d, s_qt, s_qh, s_qd, c, s, mask, half)
    tl.store(q_out + t * s_ot + h * s_oh + d, o1, mask=mask)
    tl.store(q_out + t * s_ot + h * s_oh + d + half, o2, mask=mask)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot < 0:  # padding token: nothing stored
        return
    blk = slot // BLOCK_SIZE  # (a constexpr: no 64-bit division)
    off = slot % BLOCK_SIZE
    kh = tl.arange(0, BLOCK_KH)[:, None]
    kmask = (kh < num_kv_heads) & dmask
    k1, k2 = _rotate(k, t, kh, d, s_kt, s_kh, s_kd, c, s, kmask, half)
    k1, k2 = cache_value(k1, k_cache, k_inv), cache_value(k2, k_cache, k_inv)
    kdst = k_cache + blk * c_kb + off * c_ks + kh * c_kh
    tl.store(kdst + d * c_kd, k1, mask=kmask)
    tl.store(kdst + (d + half) * c_kd, k2, mask=kmask)
    vsrc = v + t * s_vt + kh * s_vh
    v1 = cache_value(tl.load(vsrc + d * s_vd, mask=kmask), v_cache, v_inv)
    v2 = cache_value(tl.load(vsrc + (d + half) * s_vd, mask=kmask), v_cache, v_inv)
    vdst = v_cache + blk * c_vb + off * c_vs + kh * c_vh
    tl.store(vdst + d * c_vd, v1, mask=kmask)
    tl.store(vdst + (d + half) * c_vd, v2, mask=kmask)
    if NEW_KV:  # the same, laid end to end
        kn, vn = k_new + t * s_nt + kh * s_nh, v_new + t * s_nt + kh * s_nh
        tl.store(kn + d, k1, mask=kmask)
        tl.store(kn + d + half, k2, mask=kmask)
        tl.store(vn + d, v1, mask=kmask)
        tl.store(vn + d + half, v2, mask=kmask)


def rope_and_store_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0,
                          new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """new_kv: also write the stored tokens' K and V there, as the cache holds them, laid end to
    end ([num_tokens, kv_heads, head_dim] each, contiguous; padding tokens' rows unwritten): the
    prefill attention kernel reads a step's own keys from them."""
    num_tokens, num_heads, head_dim = q.shape
    half = head_dim // 2
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    k_new, v_new = new_kv if new_kv is not None else (k_cache, v_cache)  # (unwritten without new_kv)
    assert new_kv is None or all(t.is_contiguous() and t.shape == k.shape for t in new_kv)
    _rope_store_kernel[(num_tokens,)](
        q, k, v, cos, sin, q_out, k_cache, v_cache, slot_mapping, k_new, v_new,
        *q.stride(), *k.stride(), *v.stride(), cos.stride(0), q_out.stride(0), q_out.stride(1),
        *k_cache.stride(), *v_cache.stride(), *k_new.stride()[:2], num_heads, k.shape[1], half,
        1.0 / k_scale, 1.0 / v_scale, BLOCK_SIZE=k_cache.shape[1], BLOCK_H=next_pow2(num_heads),
        BLOCK_KH=next_pow2(k.shape[1]), BLOCK_D=next_pow2(half), NEW_KV=new_kv is not None, **pdl(q),
    )
    return q_out


def rope_and_store(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> torch.Tensor:
    fn = rope_and_store_triton if use_triton(q) else rope_and_store_ref
    return fn(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)
