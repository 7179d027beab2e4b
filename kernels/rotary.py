"""Rotary position embedding (neox style, as Llama/Qwen use in transformers), plain torch.

`rope_inv_freq` covers the rope variants (default, linear, dynamic NTK, llama3, YaRN, LongRoPE),
`rope_attention_factor` the scale YaRN and LongRoPE put on cos and sin; `rotary_cos_sin` builds
the cache once; `apply_rotary` rotates q and k in place of their values.
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
    LongRoPE uses `long_factor` when `max_model_len` exceeds original_max_position_embeddings,
    else `short_factor`, fixed for the engine's life (transformers switches per forward on the
    longest position of the batch, vLLM on max_model_len; the two agree on a sequence that is
    wholly within, or wholly past, the original length). `head_dim` is the rotated width (the
    head's, times partial_rotary_factor).
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
    if rope_type == "yarn":
        return _yarn(rope, dim, base, max_position)
    if rope_type == "longrope":
        original = int(rope["original_max_position_embeddings"])
        long = max_model_len is not None and max_model_len > original
        factors = torch.tensor(rope["long_factor" if long else "short_factor"], dtype=torch.float32)
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (factors * base ** shape)
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


def _scaling_factor(rope: dict[str, Any], max_position: int) -> float:
    """YaRN's and LongRoPE's `factor`, else max_position / original (Phi-3, DeepSeek)."""
    factor = rope.get("factor")
    if factor is None:
        return max_position / float(rope["original_max_position_embeddings"])
    return float(factor)


def _yarn(rope: dict[str, Any], dim: int, base: float, max_position: int) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): interpolate the low frequencies by `factor`, keep the high ones,
    with a linear ramp between the beta_fast / beta_slow rotation counts; transformers' order
    of float operations, so the result is bit-identical to it."""
    factor = _scaling_factor(rope, max_position)
    original = rope["original_max_position_embeddings"]
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers': no zero-width ramp)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: extrapolate (high frequency), 0: interpolate
    return interpolation * (1 - keep) + extrapolation * keep


def rope_attention_factor(rope: dict[str, Any], max_position: int) -> float:
    """The scale on cos and sin (1.0 but for YaRN and LongRoPE): the config's
    `attention_factor`, else YaRN's 0.1 ln(s) + 1 (mscale / mscale_all_dim as DeepSeek sets
    them) or LongRoPE's sqrt(1 + ln(s) / ln(original))."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor = _scaling_factor(rope, max_position)
    if rope_type == "longrope":
        if factor <= 1.0:
            return 1.0
        original = float(rope["original_max_position_embeddings"])
        return math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def rotary_cos_sin(inv_freq: torch.Tensor, max_position: int,
                   attention_factor: float = 1.0) -> torch.Tensor:
    """`[max_position, head_dim]`: cos of every position's angles, then sin (float32), each times
    `attention_factor` (rope_attention_factor)."""
    positions = torch.arange(max_position, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim // 2]
    if attention_factor == 1.0:
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)


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
