"""Write a step's K and V into the paged cache through slot_mapping."""
import torch


def store_kvcache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size,
    num_kv_heads, head_dim]; slot_mapping: [num_tokens], slot = block * block_size + offset,
    -1 marks a padding token whose K/V is not stored."""
    keep = (slot_mapping >= 0).nonzero().squeeze(1)
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key[keep])
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value[keep])
