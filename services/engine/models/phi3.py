"""Phi-3 / Phi-4 (Phi3ForCausalLM; Phi-4 and Phi-4-mini use the same architecture): the Llama
decoder whose checkpoints store q/k/v fused as `qkv_proj` and gate/up as `gate_up_proj` (our
packed layers load them whole: PackedLinear splits the fused tensor by its shards, and each tp
rank keeps its slice of each). Every layer uses `sliding_window` when the config sets one (the
4k Phi-3-mini: 2047). The 128k variants rotate with LongRoPE, Phi-4-mini a partial rotary
(partial_rotary_factor 0.75): layers/rotary.py."""

from __future__ import annotations

from shoal.services.engine.models import sliding_window
from shoal.services.engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    sliding_windows = staticmethod(sliding_window.every_layer)
