"""Rotary position embedding (neox style, as Llama/Qwen use in transformers), plain torch.

`rope_inv_freq` covers the rope variants our models need (default, linear, dynamic NTK, llama3);
`rotary_cos_sin` builds the cache once; `apply_rotary` rotates q and k in place of their values.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(rope: dict[str, Any], head_dim: int, max_position: int,
                  max_model_len: int | None = None) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` float32, computed as transformers does (bit-identical).

    `rope` is the config's rope_parameters: rope_type, rope_theta and the variant's factors.
    Dynamic NTK follows transformers up to `max_position` (no change) and beyond it uses one
    fixed base for `max_model_len` (vLLM's choice; transformers recomputes per batch).
    """
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    base = float(rope.get("rope_theta", 10000.0))
    dim = head_dim
    if rope_type == "dynamic" and max_model_len is not None and max_model_len > max_position:
        factor = float(rope["factor"])
        base = base * ((factor * max_model_len / max_position) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    if rope_type in ("default", "dynamic"):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope["factor"])
    if rope_type == "llama3":
        return _llama3(inv_freq, rope)
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported")


def _llama3(inv_freq: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    factor = rope["factor"]
    low_freq_factor = rope["low_freq_factor"]
    high_freq_factor = rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_cos_sin(inv_freq: torch.Tensor, max_position: int) -> torch.Tensor:
    """`[max_position, head_dim]`: cos of every position's angles, then sin (float32)."""
    positions = torch.arange(max_position, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim // 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rotary(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin: torch.Tensor,  # [max_position, head_dim] from rotary_cos_sin
) -> tuple[torch.Tensor, torch.Tensor]:
    half = cos_sin.shape[1] // 2
    cs = cos_sin.index_select(0, positions).to(q.dtype)  # [num_tokens, head_dim]
    cos, sin = cs[:, None, :half], cs[:, None, half:]  # [num_tokens, 1, head_dim // 2]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Same arithmetic as transformers' `x * cos + rotate_half(x) * sin` with cos = cat(c, c).
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
