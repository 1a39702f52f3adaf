"""Write a step's K and V into the paged cache through slot_mapping."""
import torch

from picovllm.kernels.triton_utils import next_pow2, tl, triton


def store_kvcache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size,
    num_kv_heads, head_dim]; slot_mapping: [num_tokens], slot = block * block_size + offset,
    -1 marks a padding token whose K/V is not stored."""
    keep = (slot_mapping >= 0).nonzero().squeeze(1)
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key[keep])
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value[keep])


@triton.jit
def _store_kvcache_kernel(
    key, value, k_cache, v_cache, slot_mapping,
    s_kt, s_kh, s_kd, s_vt, s_vh, s_vd,  # key / value strides (token, head, dim)
    c_kb, c_ks, c_kh, c_kd, c_vb, c_vs, c_vh, c_vd,  # cache strides (block, slot, head, dim)
    block_size, num_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_heads) & (d < head_dim)
    k = tl.load(key + token * s_kt + h * s_kh + d * s_kd, mask=mask)
    v = tl.load(value + token * s_vt + h * s_vh + d * s_vd, mask=mask)
    tl.store(k_cache + blk * c_kb + off * c_ks + h * c_kh + d * c_kd, k, mask=mask)
    tl.store(v_cache + blk * c_vb + off * c_vs + h * c_vh + d * c_vd, v, mask=mask)


def store_kvcache_triton(key, value, k_cache, v_cache, slot_mapping) -> None:
    num_tokens, num_heads, head_dim = key.shape
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        k_cache.shape[1], num_heads, head_dim,
        BLOCK_H=next_pow2(num_heads), BLOCK_D=next_pow2(head_dim),
    )
