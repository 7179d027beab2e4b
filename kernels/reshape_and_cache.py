"""reshape_and_cache: write this step's keys and values into the paged KV cache (plain torch).

The CPU path and the reference for the Triton kernel. Layout (docs/architecture.md "KV-cache
contract"): caches `[num_blocks, block_size, num_kv_heads, head_dim]`, `slot_mapping` int64,
-1 = skip.
"""

from __future__ import annotations

import torch


def reshape_and_cache(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * block_size + offset or -1
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV caches must be contiguous"
    assert k.shape == v.shape and k.shape[1:] == (num_kv_heads, head_dim), (k.shape, k_cache.shape)
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape[0] == k.shape[0]
    skip = slot_mapping < 0
    if bool(skip.any()):
        keep = ~skip
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    # [num_blocks * block_size, num_kv_heads, head_dim]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    flat_k.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
