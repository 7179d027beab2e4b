"""Rotary embedding (neox style) in Triton: one program per token rotates all its q and k heads.
The cos/sin cache is the torch path's (`rotary_cos_sin`, so every rope variant is covered); each
product and sum is rounded to the input dtype as torch's eager ops round, so results match it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels._utils import check_same_device, next_power_of_2


@triton.jit
def _rotate_heads(x_ptr, out_ptr, token, x_stride, cos, sin, num_heads,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    src = x_ptr + token * x_stride + heads * (2 * HALF) + dims
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    a = (x1 * cos).to(dtype).to(tl.float32)
    b = (x2 * sin).to(dtype).to(tl.float32)
    c = (x2 * cos).to(dtype).to(tl.float32)
    d = (x1 * sin).to(dtype).to(tl.float32)
    dst = out_ptr + token * num_heads * (2 * HALF) + heads * (2 * HALF) + dims
    tl.store(dst, (a - b).to(dtype), mask=mask)
    tl.store(dst + HALF, (c + d).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_sin_ptr, q_stride, k_stride,
                   num_heads, num_kv_heads, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr):
    token = tl.program_id(0)
    pos = tl.load(pos_ptr + token)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    row = cos_sin_ptr + pos * (2 * HALF) + dims
    dtype = q_out_ptr.dtype.element_ty
    cos = tl.load(row, mask=dims < HALF, other=0.0).to(dtype).to(tl.float32)  # [1, BLOCK_HALF]
    sin = tl.load(row + HALF, mask=dims < HALF, other=0.0).to(dtype).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, token, q_stride, cos, sin, num_heads, HALF, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_ptr, k_out_ptr, token, k_stride, cos, sin, num_kv_heads, HALF, BLOCK_KVH,
                  BLOCK_HALF)


def apply_rotary_triton(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], token stride free
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin: torch.Tensor,  # [max_position, head_dim] float32 from rotary_cos_sin
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert head_dim % 2 == 0 and k.shape == (num_tokens, num_kv_heads, head_dim)
    for x in (q, k):
        assert x.stride(2) == 1 and x.stride(1) == head_dim, f"heads must be dense {x.stride()}"
    assert q.dtype == k.dtype
    assert cos_sin.shape[1] == head_dim and cos_sin.is_contiguous()
    assert cos_sin.dtype == torch.float32
    assert positions.shape == (num_tokens,) and positions.is_contiguous()
    check_same_device(q, k, positions, cos_sin)
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=k.dtype, device=k.device)
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](q, k, q_out, k_out, positions, cos_sin, q.stride(0),
                                      k.stride(0), num_heads, num_kv_heads, HALF=half,
                                      BLOCK_HALF=next_power_of_2(half),
                                      BLOCK_H=next_power_of_2(num_heads),
                                      BLOCK_KVH=next_power_of_2(num_kv_heads))
    return q_out, k_out
