"""reshape_and_cache in Triton (the CUDA path): one program per token writes its keys and values
into the paged cache at `slot_mapping[t]`, and returns at once on -1 (nano-vllm's store kernel)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels._utils import check_heads, check_kv_cache, check_same_device, next_power_of_2


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     k_stride, v_stride, D: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    k = tl.load(k_ptr + token * k_stride + offs, mask=mask)
    v = tl.load(v_ptr + token * v_stride + offs, mask=mask)
    dst = slot * D + offs  # a slot's num_kv_heads * head_dim values are contiguous
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache_triton(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], token stride free
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * block_size + offset or -1
) -> None:
    _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_heads(k, num_kv_heads, head_dim, "k")
    check_heads(v, num_kv_heads, head_dim, "v")
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (k.shape[0],)
    assert slot_mapping.is_contiguous()
    check_same_device(k, v, k_cache, v_cache, slot_mapping)
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    d = num_kv_heads * head_dim
    _store_kv_kernel[(num_tokens,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                                    D=d, BLOCK_D=next_power_of_2(d))
