"""Rotary embedding module: reads the rope parameters from a transformers config, caches cos/sin."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.kernels import Ops
from shoal.kernels.rotary import rope_inv_freq, rotary_cos_sin


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """rope_parameters (transformers >= 5) or the older rope_theta + rope_scaling pair."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return dict(params)
    rope = dict(getattr(hf_config, "rope_scaling", None) or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    return rope


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: dict[str, Any], head_dim: int, max_position: int, max_model_len: int,
                 ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        inv_freq = rope_inv_freq(rope, head_dim, max_position, max_model_len)
        cache = rotary_cos_sin(inv_freq, max(max_position, max_model_len))
        self.register_buffer("cos_sin", cache, persistent=False)  # [max_len, head_dim] float32

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.apply_rotary(q, k, positions, self.cos_sin)
