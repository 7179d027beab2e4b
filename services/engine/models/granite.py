"""Granite (GraniteForCausalLM, IBM Granite 3.x dense): the Llama decoder with four multipliers,
as transformers applies them: the embedding times `embedding_multiplier`, attention scaled by
`attention_multiplier` (instead of head_dim ** -0.5), each block's output times
`residual_multiplier` before its residual add, and the logits divided by `logits_scaling`."""

from __future__ import annotations

from typing import Any

import torch

from shoal.services.engine.layers.attention import AttentionMetadata
from shoal.services.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(cfg, *args, **kwargs)
        self.residual_multiplier = float(cfg.residual_multiplier)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The Llama layer's, each block's output scaled before the fused residual add."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm.forward(hidden)
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.self_attn.forward(positions, hidden, meta) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm.forward(hidden, residual)
        return self.mlp.forward(hidden) * self.residual_multiplier, residual


def granite_options(cfg: Any, layer: int) -> dict[str, Any]:
    return {"scale": float(cfg.attention_multiplier)}


class GraniteForCausalLM(LlamaForCausalLM):
    decoder_layer = GraniteDecoderLayer
    layer_options = staticmethod(granite_options)

    def __init__(self, cfg: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(cfg, *args, **kwargs)
        self.logits_scaling = float(getattr(cfg, "logits_scaling", 1.0) or 1.0)

    @staticmethod
    def embedding_scale(cfg: Any) -> float | None:
        return float(getattr(cfg, "embedding_multiplier", 1.0))

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden, logits_indices) / self.logits_scaling
