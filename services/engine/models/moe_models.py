"""Mixture-of-experts families: the Llama decoder with an MoE MLP (layers/moe.py) in its layers.

- Qwen3-MoE: Qwen3's attention (q/k norms); experts in the layers `decoder_sparse_step` selects
  minus `mlp_only_layers` (dense there, of `intermediate_size`); `norm_topk_prob`; no shared
  expert.
- Qwen2-MoE: Qwen2's attention (biased q/k/v, `qkv_bias`); the same layer rule; a shared expert
  of `shared_expert_intermediate_size` beside the routed ones, scaled by sigmoid(its gate).
- Mixtral: Mistral's attention; experts in every layer (`intermediate_size` each, `w1`/`w3`/`w2`
  under `block_sparse_moe` in its checkpoints), top-k weights always renormalised.

On CUDA they run eagerly (no decode graphs): the fused layer's group sizes are read on the host.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shoal.services.engine.distributed.parallel_state import ParallelContext
from shoal.services.engine.layers.moe import FusedMoE, expert_target
from shoal.services.engine.models import sliding_window
from shoal.services.engine.models.llama import (
    LlamaForCausalLM, LlamaMLP, Qwen2ForCausalLM, dense_mlp
)
from shoal.services.engine.models.qwen3 import Qwen3ForCausalLM

QWEN_PROJECTIONS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
MIXTRAL_PROJECTIONS = {"w1": "gate", "w3": "up", "w2": "down"}


def is_sparse_layer(cfg: Any, layer: int) -> bool:
    """Qwen-MoE's rule (transformers'): experts unless the layer is in `mlp_only_layers`, every
    `decoder_sparse_step`-th layer."""
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return (layer not in (getattr(cfg, "mlp_only_layers", None) or [])
            and cfg.num_experts > 0 and (layer + 1) % step == 0)


def check_activation(cfg: Any) -> None:
    from shoal.services.engine.config import ConfigError

    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ConfigError(f"MoE experts with hidden_act={cfg.hidden_act!r}: only silu is built")


def qwen3_moe_mlp(cfg: Any, layer: int, parallel: ParallelContext) -> nn.Module:
    check_activation(cfg)
    if not is_sparse_layer(cfg, layer):
        return dense_mlp(cfg, layer, parallel)
    return FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                    cfg.moe_intermediate_size, bool(cfg.norm_topk_prob), parallel)


def qwen2_moe_mlp(cfg: Any, layer: int, parallel: ParallelContext) -> nn.Module:
    check_activation(cfg)
    if not is_sparse_layer(cfg, layer):
        return dense_mlp(cfg, layer, parallel)
    shared = None
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        shared = LlamaMLP(cfg, False, parallel, cfg.shared_expert_intermediate_size)
    return FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                    cfg.moe_intermediate_size, bool(cfg.norm_topk_prob), parallel, shared)


def mixtral_mlp(cfg: Any, layer: int, parallel: ParallelContext) -> nn.Module:
    check_activation(cfg)
    return FusedMoE(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                    cfg.intermediate_size, True, parallel)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    cuda_graphs = False  # the fused layer reads its group sizes on the host (layers/moe.py)
    sliding_windows = staticmethod(sliding_window.every_layer)  # transformers: all, when used
    build_mlp = staticmethod(qwen3_moe_mlp)

    def checkpoint_target(self, name: str) -> tuple[str, Any] | None:
        return expert_target(name, QWEN_PROJECTIONS)


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    cuda_graphs = False
    build_mlp = staticmethod(qwen2_moe_mlp)

    @staticmethod
    def attention_options(cfg: Any) -> tuple[bool, bool, bool]:
        return bool(getattr(cfg, "qkv_bias", True)), False, False

    def checkpoint_target(self, name: str) -> tuple[str, Any] | None:
        return expert_target(name, QWEN_PROJECTIONS)


class MixtralForCausalLM(LlamaForCausalLM):
    cuda_graphs = False
    sliding_windows = staticmethod(sliding_window.every_layer)
    build_mlp = staticmethod(mixtral_mlp)

    def checkpoint_target(self, name: str) -> tuple[str, Any] | None:
        if ".block_sparse_moe." not in name:  # (transformers >= 5 may save it as `mlp`)
            return expert_target(name, MIXTRAL_PROJECTIONS)
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's checkpoints' name
        return expert_target(name, MIXTRAL_PROJECTIONS) or (name, None)
