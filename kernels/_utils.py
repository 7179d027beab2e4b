"""Helpers shared by the Triton launchers: power-of-two block widths, layout checks (the
contract is checked, not assumed) and interpreter detection (TRITON_INTERPRET=1, CPU tensors)."""

from __future__ import annotations

import os

import torch


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (>= 1): `tl.arange` widths must be powers of two."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def is_interpreting() -> bool:
    """True when Triton kernels run in its CPU interpreter (read when kernel modules import)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """Both caches `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous, same shape."""
    assert k_cache.dim() == 4, f"KV cache must be 4-D, got {tuple(k_cache.shape)}"
    assert k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV caches must be contiguous"
    assert k_cache.device == v_cache.device
    return int(k_cache.shape[1]), int(k_cache.shape[2]), int(k_cache.shape[3])


def check_heads(x: torch.Tensor, num_heads: int, head_dim: int, name: str) -> None:
    """`[num_tokens, num_heads, head_dim]` whose (heads, dim) part is dense; the token stride is
    free (q/k/v are views into the packed qkv projection)."""
    assert x.dim() == 3 and x.shape[1:] == (num_heads, head_dim), (name, tuple(x.shape))
    assert x.stride(2) == 1 and x.stride(1) == head_dim, f"{name}: heads must be dense {x.stride()}"


def check_same_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    assert len(devices) == 1, f"tensors on several devices: {devices}"
