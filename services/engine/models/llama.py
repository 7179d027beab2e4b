"""Llama-family decoder (Llama, Mistral, Qwen2; Qwen3 adds q/k norms in qwen3.py).

One flattened varlen batch per forward: `input_ids`/`positions` are `[num_tokens]` and attention
goes through the paged KV cache, over a sliding window in the layers whose config says so
(sliding_window.py). Module names mirror transformers' so checkpoints load directly, with q/k/v
and gate/up packed (see `packed_modules_mapping`).

Parallel (a `ParallelContext`): the layers split heads and the MLP across the tp ranks
(layers/linear.py, layers/embedding.py); a pipeline stage builds only its contiguous range of
decoder layers (the others are empty placeholders, so checkpoint names keep their indexes), the
embedding on the first stage and the final norm and LM head on the last; `skipped_prefixes` names
the checkpoint tensors that belong to other stages, which the loader does not read.

A layer's submodules are called by `.forward` (no hooks are used): nn.Module.__call__'s hook
machinery costs ~0.75 us a call, ~12 calls a layer, ~0.3 ms of a ~9 ms single-stream step of
SmolLM2 on two cores (issue 31).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shoal.kernels import Ops
from shoal.services.engine.layers.attention import Attention, AttentionMetadata
from shoal.services.engine.distributed.parallel_state import (
    ParallelContext, kv_heads_per_rank, stage_layers
)
from shoal.services.engine.layers.activation import gated_activation
from shoal.services.engine.layers.embedding import LMHead, VocabEmbedding
from shoal.services.engine.layers.layernorm import RMSNorm
from shoal.services.engine.layers.linear import GateUpLinear, QKVLinear, RowParallelLinear
from shoal.services.engine.layers.rotary import RotaryEmbedding, rope_parameters
from shoal.services.engine.models import sliding_window


def head_dim_of(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, cfg: Any, max_model_len: int, ops: Ops, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool, window: int | None, parallel: ParallelContext, *,
                 scale: float | None = None, softcap: float | None = None,
                 rope: dict[str, Any] | None = None, norm_class: type[RMSNorm] = RMSNorm,
                 sinks: bool = False) -> None:
        """`scale` (default head_dim ** -0.5), `softcap` (the attention logits' soft-cap),
        `rope` (default: the config's) and `sinks` (gpt-oss's per-head sink logits, held by
        `attn`) are what a family sets per layer (`layer_options`)."""
        super().__init__()
        self.parallel = parallel
        total_heads = cfg.num_attention_heads
        total_kv_heads = getattr(cfg, "num_key_value_heads", None) or total_heads
        self.num_heads = total_heads // parallel.tp_size  # this rank's heads
        self.num_kv_heads = kv_heads_per_rank(total_kv_heads, parallel.tp_size)
        self.head_dim = head_dim_of(cfg)
        self.qkv_proj = QKVLinear(cfg.hidden_size, total_heads, total_kv_heads, self.head_dim,
                                  bias=qkv_bias, parallel=parallel)
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, cfg.hidden_size, bias=o_bias,
                                        parallel=parallel)
        self.q_norm = norm_class(self.head_dim, cfg.rms_norm_eps, ops) if qk_norm else None
        self.k_norm = norm_class(self.head_dim, cfg.rms_norm_eps, ops) if qk_norm else None
        self.rotary_emb = RotaryEmbedding(rope or rope_parameters(cfg), self.head_dim,
                                          cfg.max_position_embeddings, max_model_len, ops)
        sink_logits = None
        if sinks:
            sink_logits = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
            sink_logits.weight_loader = self._load_sinks  # type: ignore[attr-defined]
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              self.head_dim ** -0.5 if scale is None else scale, ops, window,
                              softcap, sink_logits)

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's heads' sinks out of all of them."""
        assert loaded.shape == (self.num_heads * self.parallel.tp_size,), tuple(loaded.shape)
        param.data.copy_(loaded.narrow(0, self.parallel.tp_rank * self.num_heads, self.num_heads))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        # [num_tokens, heads + 2 * kv_heads, head_dim] -> q [.., num_heads, ..], k and v
        # [.., num_kv_heads, ..]: strided views of the packed output (one view, one split)
        q, k, v = self.qkv_proj.forward(hidden).view(num_tokens, -1, self.head_dim).split(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        q, k = self.rotary_emb.forward(positions, q, k)
        out = self.attn.forward(q, k, v, meta)  # [num_tokens, num_heads, head_dim]
        return self.o_proj.forward(out.view(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any, bias: bool, parallel: ParallelContext,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size  # (a shared expert's own size)
        self.gate_up_proj = GateUpLinear(cfg.hidden_size, inter, bias=bias, parallel=parallel)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=bias, parallel=parallel)
        self.act_fn = gated_activation(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act_fn.forward(self.gate_up_proj.forward(x)))


MlpBuilder = Callable[[Any, int, ParallelContext], nn.Module]
"""(hf config, layer index, parallel) -> that layer's MLP: a dense one, or an MoE (moe.py)."""


def dense_mlp(cfg: Any, layer: int, parallel: ParallelContext) -> nn.Module:
    return LlamaMLP(cfg, bool(getattr(cfg, "mlp_bias", False)), parallel)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, max_model_len: int, ops: Ops, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool, window: int | None, parallel: ParallelContext,
                 mlp: nn.Module, norm_class: type[RMSNorm] = RMSNorm,
                 **attention: Any) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, max_model_len, ops, qkv_bias, o_bias, qk_norm,
                                        window, parallel, norm_class=norm_class, **attention)
        self.mlp = mlp
        self.input_layernorm = norm_class(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = norm_class(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm.forward(hidden)
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.self_attn.forward(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm.forward(hidden, residual)
        return self.mlp.forward(hidden), residual


IntermediateTensors = tuple[torch.Tensor, torch.Tensor]
"""(hidden, residual), each [num_tokens, hidden]: what a pipeline stage hands to the next."""

LayerOptions = Callable[[Any, int], dict[str, Any]]
"""(hf config, layer index) -> that layer's attention keywords (LlamaAttention: scale, softcap,
rope); Gemma's and Granite's differ from Llama's defaults."""


def no_options(cfg: Any, layer: int) -> dict[str, Any]:
    return {}


class LlamaModel(nn.Module):
    def __init__(self, cfg: Any, max_model_len: int, ops: Ops, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool, windows: list[int | None], parallel: ParallelContext,
                 build_mlp: MlpBuilder = dense_mlp, *,
                 decoder_layer: type[LlamaDecoderLayer] = LlamaDecoderLayer,
                 layer_options: LayerOptions = no_options, norm_class: type[RMSNorm] = RMSNorm,
                 embedding_scale: float | None = None) -> None:
        """`embedding_scale`: the embedding's rows times it (Gemma: sqrt(hidden), Granite:
        embedding_multiplier), rounded to the model's dtype as transformers' tensor is (a Python
        float: no device tensor is made, so a decode graph can capture it)."""
        super().__init__()
        assert len(windows) == cfg.num_hidden_layers, (len(windows), cfg.num_hidden_layers)
        self.parallel = parallel
        self.embedding_scale = embedding_scale
        self._rounded_scales = {  # the scale as transformers' tensor of the model's dtype holds it
            dtype: float(torch.tensor(embedding_scale, dtype=dtype))
            for dtype in (torch.float32, torch.float16, torch.bfloat16)
        } if embedding_scale is not None else {}
        self.start, self.end = stage_layers(cfg.num_hidden_layers, parallel.pp_size,
                                            parallel.pp_rank)
        self.embed_tokens = (VocabEmbedding(cfg.vocab_size, cfg.hidden_size, parallel)
                             if parallel.is_first_stage else None)
        self.layers = nn.ModuleList(
            decoder_layer(cfg, max_model_len, ops, qkv_bias, o_bias, qk_norm, window, parallel,
                          build_mlp(cfg, i, parallel), norm_class, **layer_options(cfg, i))
            if self.start <= i < self.end else nn.Identity()  # another stage's layer
            for i, window in enumerate(windows))
        self.norm = (norm_class(cfg.hidden_size, cfg.rms_norm_eps, ops)
                     if parallel.is_last_stage else None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] -> [num_tokens, hidden]: the embedding rows, scaled where the family
        says (`embedding_scale`)."""
        assert self.embed_tokens is not None
        hidden = self.embed_tokens(input_ids)
        if self.embedding_scale is not None:
            hidden = hidden * self._rounded_scales.get(hidden.dtype, self.embedding_scale)
        return hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                intermediate: IntermediateTensors | None = None
                ) -> torch.Tensor | IntermediateTensors:
        """The last stage returns the normed hidden states; the others (hidden, residual)."""
        residual: torch.Tensor | None = None
        if intermediate is None:
            hidden = self.embed(input_ids)  # [num_tokens, hidden]
        else:
            hidden, residual = intermediate
        for layer in self.layers[self.start:self.end]:
            hidden, residual = layer.forward(positions, hidden, residual, meta)
        assert residual is not None
        if self.norm is None:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, cfg: Any, max_model_len: int, ops: Ops,
                 parallel: ParallelContext | None = None) -> None:
        super().__init__()
        parallel = parallel or ParallelContext.single()
        self.hidden_size = cfg.hidden_size
        qkv_bias, o_bias, qk_norm = self.attention_options(cfg)
        self.model = LlamaModel(cfg, max_model_len, ops, qkv_bias, o_bias, qk_norm,
                                self.sliding_windows(cfg), parallel, self.build_mlp,
                                decoder_layer=self.decoder_layer,
                                layer_options=self.layer_options, norm_class=self.norm_class,
                                embedding_scale=self.embedding_scale(cfg))
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        tied = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = (LMHead(cfg.vocab_size, cfg.hidden_size, tied, parallel)
                        if parallel.is_last_stage else None)
        self.skipped_prefixes = self._other_stages(cfg, parallel)

    def _other_stages(self, cfg: Any, parallel: ParallelContext) -> tuple[str, ...]:
        """Checkpoint name prefixes this pipeline stage does not hold."""
        skipped = [f"model.layers.{i}." for i in range(cfg.num_hidden_layers)
                   if not self.model.start <= i < self.model.end]
        if self.model.embed_tokens is None and not (self.tie_word_embeddings
                                                    and parallel.is_last_stage):
            skipped.append("model.embed_tokens.")  # (tied: the last stage's LM head reads it)
        if not parallel.is_last_stage:
            skipped += ["model.norm.", "lm_head."]
        return tuple(skipped)

    @staticmethod
    def attention_options(cfg: Any) -> tuple[bool, bool, bool]:
        """(q/k/v bias, o_proj bias, q/k RMSNorm): Llama and Mistral use `attention_bias`."""
        bias = bool(getattr(cfg, "attention_bias", False))
        return bias, bias, False

    sliding_windows = staticmethod(sliding_window.full_attention)
    """Per layer: its attention window, None = full (models/sliding_window.py)."""

    cuda_graphs = True
    """Whether a decode step can be captured as a CUDA graph (no host sync in the forward)."""

    build_mlp: MlpBuilder = staticmethod(dense_mlp)  # type: ignore[assignment]
    """Per layer: its MLP (the MoE families build experts: models/moe_models.py)."""

    decoder_layer: type[LlamaDecoderLayer] = LlamaDecoderLayer
    """The layer's residual wiring (Gemma's four norms, Granite's residual multiplier)."""

    norm_class: type[RMSNorm] = RMSNorm
    """Every RMSNorm of the model (Gemma's scale by 1 + weight: models/gemma.py)."""

    layer_options: LayerOptions = staticmethod(no_options)  # type: ignore[assignment]
    """Per layer: the attention's scale, soft-cap and rope where the family sets them."""

    @staticmethod
    def embedding_scale(cfg: Any) -> float | None:
        """What the embedding's rows are multiplied by (None: nothing)."""
        return None

    def checkpoint_target(self, name: str) -> tuple[str, Any] | None:
        """A checkpoint name this family stores otherwise -> (our parameter, shard id); None:
        the name is ours, or a packed one (`packed_modules_mapping`). The loader asks first."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                intermediate: IntermediateTensors | None = None
                ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, meta, intermediate)

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "logits are computed on the last pipeline stage"
        return self.lm_head(hidden, logits_indices)  # [num_logits, vocab] float32


class MistralForCausalLM(LlamaForCausalLM):
    sliding_windows = staticmethod(sliding_window.every_layer)


class Qwen2ForCausalLM(LlamaForCausalLM):
    sliding_windows = staticmethod(sliding_window.by_layer_types)

    @staticmethod
    def attention_options(cfg: Any) -> tuple[bool, bool, bool]:
        return True, False, False  # Qwen2: biased q/k/v, unbiased o_proj
