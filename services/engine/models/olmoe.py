"""OLMoE (`OlmoeForCausalLM`): the Llama decoder with experts in every layer (`num_experts` of
`intermediate_size`, top-k not renormalised unless `norm_topk_prob`, no shared expert) and q/k
RMSNorms over the whole projection (all heads together, before the head split), not per head as
Qwen3's.

The whole-projection norm replaces LlamaAttention's per-head q/k norms after construction (they
share the call site: `q_norm(q)` on [tokens, heads, head_dim]), so the Llama decoder stays one
class. Under tensor parallelism each rank holds its heads' slice of the projection: the sum of
squares is all-reduced over the tp group before the scale, so every rank divides by the full
projection's RMS (vLLM all-gathers q/k instead; the sum is one float per token).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.services.engine.distributed.parallel_state import ParallelContext
from shoal.services.engine.model_limits import tp_divides_kv_heads
from shoal.services.engine.layers.moe import FusedMoE, expert_target
from shoal.services.engine.models.llama import LlamaAttention, LlamaForCausalLM, head_dim_of
from shoal.services.engine.models.moe_models import QWEN_PROJECTIONS, check_activation


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole q or k projection [tokens, heads, head_dim] (this rank's heads)."""

    def __init__(self, local_size: int, total_size: int, eps: float,
                 parallel: ParallelContext) -> None:
        super().__init__()
        self.eps, self.total_size, self.parallel = eps, total_size, parallel
        self.weight = nn.Parameter(torch.ones(local_size), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        assert loaded.shape == (self.total_size,), (tuple(loaded.shape), self.total_size)
        n = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.parallel.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(x.shape[0], -1).float()
        squares = self.parallel.all_reduce(flat.pow(2).sum(-1, keepdim=True))
        flat = flat * torch.rsqrt(squares / self.total_size + self.eps)
        return (flat * self.weight.float()).to(x.dtype).view_as(x)


def olmoe_mlp(cfg: Any, layer: int, parallel: ParallelContext) -> nn.Module:
    check_activation(cfg)
    return FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                    cfg.intermediate_size, bool(cfg.norm_topk_prob), parallel)


class OlmoeForCausalLM(LlamaForCausalLM):
    cuda_graphs = False  # the fused layer reads its group sizes on the host (layers/moe.py)
    build_mlp = staticmethod(olmoe_mlp)

    def __init__(self, cfg: Any, max_model_len: int, ops: Any,
                 parallel: ParallelContext | None = None) -> None:
        from shoal.services.engine.config import ConfigError

        if getattr(cfg, "clip_qkv", None) is not None:  # no released OLMoE sets it
            raise ConfigError("OLMoE with clip_qkv is not supported")
        parallel = parallel or ParallelContext.single()
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        if not tp_divides_kv_heads(kv_heads, parallel.tp_size):
            raise ConfigError(f"OLMoE's k norm spans all {kv_heads} KV heads: tensor parallel "
                              f"size {parallel.tp_size} must divide them")
        super().__init__(cfg, max_model_len, ops, parallel)
        head_dim = head_dim_of(cfg)
        for layer in self.model.layers:
            attn = getattr(layer, "self_attn", None)  # (another pipeline stage's: Identity)
            if isinstance(attn, LlamaAttention):
                attn.q_norm = ProjectionRMSNorm(attn.num_heads * head_dim,
                                                cfg.num_attention_heads * head_dim,
                                                cfg.rms_norm_eps, parallel)
                attn.k_norm = ProjectionRMSNorm(attn.num_kv_heads * head_dim,
                                                kv_heads * head_dim, cfg.rms_norm_eps, parallel)

    @staticmethod
    def attention_options(cfg: Any) -> tuple[bool, bool, bool]:
        bias = bool(getattr(cfg, "attention_bias", False))
        return bias, bias, True

    def checkpoint_target(self, name: str) -> tuple[str, Any] | None:
        return expert_target(name, QWEN_PROJECTIONS)
