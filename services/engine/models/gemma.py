"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's differences, each as transformers
computes it.

- RMSNorm scales by (1 + weight) (the checkpoint stores weight - 1): `GemmaRMSNorm` adds the 1
  at load, so the fused norm ops run unchanged (in a 16-bit model, 1 + weight is rounded to that
  dtype once; transformers adds it in float32 per call).
- Four norms per layer: after attention and after the MLP (before each residual add), and before
  the MLP (`GemmaDecoderLayer`); Gemma 3 adds per-head q/k norms (before the rotary embedding).
- The embedding is multiplied by sqrt(hidden_size), rounded to the model's dtype.
- Attention scale query_pre_attn_scalar ** -0.5, not head_dim ** -0.5.
- Alternating sliding window: the layers whose `layer_types` entry is "sliding_attention".
- Gemma 2: attention logits soft-capped (attn_logit_softcapping, in each attention op: torch,
  C++ and Triton) and the final logits too (final_logit_softcapping, also Gemma 3's when its
  config sets it).
- Gemma 3: its sliding layers rotate with rope_parameters["sliding_attention"] (theta 10k), the
  full ones with rope_parameters["full_attention"] (theta 1M, linear scaling on 4B and up).
- GeGLU MLP: gelu_pytorch_tanh(gate) * up (layers/activation.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.kernels import Ops
from shoal.services.engine.layers.attention import AttentionMetadata
from shoal.services.engine.layers.layernorm import RMSNorm
from shoal.services.engine.layers.rotary import rope_parameters
from shoal.services.engine.models import sliding_window
from shoal.services.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight): the checkpoint's weight plus one, added once at load."""

    def __init__(self, hidden_size: int, eps: float, ops: Ops) -> None:
        super().__init__(hidden_size, eps, ops)
        self.weight.weight_loader = self._load_plus_one  # type: ignore[attr-defined]

    @staticmethod
    def _load_plus_one(param: nn.Parameter, loaded: torch.Tensor) -> None:
        assert param.shape == loaded.shape, f"shape {tuple(loaded.shape)} != {tuple(param.shape)}"
        param.data.copy_(loaded.float() + 1.0)


class GemmaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: Any, max_model_len: int, ops: Ops, *args: Any, **kwargs: Any) -> None:
        super().__init__(cfg, max_model_len, ops, *args, **kwargs)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (the MLP's normed output, the residual before it): the next layer's input
        norm (or the final one) adds the two, as the Llama layer's contract."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm.forward(hidden)
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.self_attn.forward(positions, hidden, meta)
        hidden = self.post_attention_layernorm.forward(hidden)
        hidden, residual = self.pre_feedforward_layernorm.forward(hidden, residual)
        return self.post_feedforward_layernorm.forward(self.mlp.forward(hidden)), residual


def gemma_options(cfg: Any, layer: int) -> dict[str, Any]:
    return {"scale": float(cfg.query_pre_attn_scalar) ** -0.5,
            "softcap": getattr(cfg, "attn_logit_softcapping", None),
            "rope": rope_parameters(cfg, sliding_window.layer_type(cfg, layer))}


class Gemma2ForCausalLM(LlamaForCausalLM):
    decoder_layer = GemmaDecoderLayer
    norm_class = GemmaRMSNorm
    layer_options = staticmethod(gemma_options)
    sliding_windows = staticmethod(sliding_window.alternating)

    def __init__(self, cfg: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(cfg, *args, **kwargs)
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)

    @staticmethod
    def embedding_scale(cfg: Any) -> float | None:
        return float(cfg.hidden_size) ** 0.5

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden, logits_indices)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    @staticmethod
    def attention_options(cfg: Any) -> tuple[bool, bool, bool]:
        bias = bool(getattr(cfg, "attention_bias", False))
        return bias, bias, True  # q/k norms
