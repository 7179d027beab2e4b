"""gpt-oss (`GptOssForCausalLM`): the Llama decoder with gpt-oss's differences, each where the
engine already has a hook for it.

- Attention: biased q/k/v/o; a learned sink logit per head that joins every softmax's
  denominator (the `sinks` option of LlamaAttention, applied by the torch, C++ and Triton
  attention ops); the even layers attend over a sliding window (`layer_types`), the odd ones over
  the whole context; YaRN rope (layers/rotary.py, with the config's `truncate`).
- MLP: experts in every layer (`num_local_experts` of `intermediate_size`), the shared fused
  layer (layers/moe.py) with a biased router, top-k of its logits then a softmax over those k,
  biased experts and the clamped SwiGLU (swiglu_alpha, swiglu_limit: layers/activation.py).
- Checkpoints: the bf16 layout (experts as [E, in, out] with gate/up interleaved) or the MXFP4
  one OpenAI ships (`*_blocks` / `*_scales`), dequantised at load (layers/mxfp4.py). The module
  names differ from ours in two places: `mlp.router` (our `mlp.gate`) and `self_attn.sinks`
  (held by `self_attn.attn`).

The tokenizer (o200k_harmony, through tiktoken) and the harmony chat format are what a real
checkpoint's folder brings; the engine takes them from there like any other tokenizer.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shoal.services.engine.distributed.parallel_state import ParallelContext
from shoal.services.engine.layers.activation import ClampedSwiGLU
from shoal.services.engine.layers.moe import FusedMoE, gpt_oss_expert_target
from shoal.services.engine.models import sliding_window
from shoal.services.engine.models.llama import LlamaForCausalLM


def gpt_oss_mlp(cfg: Any, layer: int, parallel: ParallelContext) -> nn.Module:
    activation = ClampedSwiGLU(float(getattr(cfg, "swiglu_alpha", 1.702)),
                               float(getattr(cfg, "swiglu_limit", 7.0)))
    return FusedMoE(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                    cfg.intermediate_size, True, parallel, bias=True, activation=activation,
                    topk_first=True)


def gpt_oss_options(cfg: Any, layer: int) -> dict[str, Any]:
    return {"sinks": True}


class GptOssForCausalLM(LlamaForCausalLM):
    cuda_graphs = False  # the fused layer reads its group sizes on the host (layers/moe.py)
    sliding_windows = staticmethod(sliding_window.alternating)
    build_mlp = staticmethod(gpt_oss_mlp)
    layer_options = staticmethod(gpt_oss_options)

    @staticmethod
    def attention_options(cfg: Any) -> tuple[bool, bool, bool]:
        bias = bool(getattr(cfg, "attention_bias", True))
        return bias, bias, False

    def checkpoint_target(self, name: str) -> tuple[str, Any] | None:
        if name.endswith(".self_attn.sinks"):
            return name.removesuffix("sinks") + "attn.sinks", None
        if ".mlp.router." in name:
            return name.replace(".mlp.router.", ".mlp.gate."), None
        return gpt_oss_expert_target(name)
