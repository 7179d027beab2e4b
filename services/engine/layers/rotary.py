"""Rotary embedding module: reads the rope parameters from a transformers config, caches cos/sin.

A partial rotary (`partial_rotary_factor` < 1, Phi-4-mini) rotates the first part of each head
only: the op (torch, C++ or Triton) sees that part as the whole head."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.kernels import Ops
from shoal.kernels.rotary import rope_attention_factor, rope_inv_freq, rotary_cos_sin


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """rope_parameters (transformers >= 5; per layer type for Gemma 3, whose dict is keyed by
    "full_attention" / "sliding_attention") or the older rope_theta + rope_scaling pair."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and layer_type is not None and isinstance(
            params.get(layer_type), dict):
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        rope = dict(params)
    else:
        rope = dict(getattr(hf_config, "rope_scaling", None) or {})
        rope.setdefault("rope_type", rope.get("type", "default"))
        rope["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    for key in ("original_max_position_embeddings", "partial_rotary_factor"):
        if key not in rope and getattr(hf_config, key, None) is not None:
            rope[key] = getattr(hf_config, key)  # (Phi-3's older configs keep them at the top)
    return rope


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: dict[str, Any], head_dim: int, max_position: int, max_model_len: int,
                 ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * float(rope.get("partial_rotary_factor") or 1.0))
        with torch.device("cpu"):  # as transformers computes it (the model's .to moves it)
            inv_freq = rope_inv_freq(rope, self.rotary_dim, max_position, max_model_len)
            cache = rotary_cos_sin(inv_freq, max(max_position, max_model_len),
                                   rope_attention_factor(rope, max_position))
        self.register_buffer("cos_sin", cache, persistent=False)  # [max_len, rotary_dim] float32

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rotary_dim == self.head_dim:
            return self.ops.apply_rotary(q, k, positions, self.cos_sin)
        r = self.rotary_dim
        q_rot, k_rot = self.ops.apply_rotary(q[..., :r].contiguous(), k[..., :r].contiguous(),
                                             positions, self.cos_sin)
        return torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)
