"""Qwen3: the Llama decoder plus a per-head RMSNorm on q and k before the rotary embedding;
sliding-window layers chosen by `layer_types`, as Qwen2."""

from __future__ import annotations

from typing import Any

from shoal.services.engine.models import sliding_window
from shoal.services.engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    sliding_windows = staticmethod(sliding_window.by_layer_types)

    @staticmethod
    def attention_options(cfg: Any) -> tuple[bool, bool, bool]:
        bias = bool(getattr(cfg, "attention_bias", False))
        return bias, bias, True
