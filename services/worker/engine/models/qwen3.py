"""Qwen3: the Llama decoder plus a per-head RMSNorm on q and k before the rotary embedding."""

from __future__ import annotations

from typing import Any

from shoal.services.worker.engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(cfg: Any) -> tuple[bool, bool, bool]:
        bias = bool(getattr(cfg, "attention_bias", False))
        return bias, bias, True
