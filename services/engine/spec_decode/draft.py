"""Model-based proposers: a draft network run autoregressively for k greedy tokens per step.

- "layer_skip": the target's first `num_draft_layers` layers, its final norm and LM head (the
  self-speculative draft of LayerSkip / draft-by-early-exit). Those layers' KV for the accepted
  tokens is exactly the target's own, so the draft shares the target's cache: it only writes the
  positions of this step, which the target's verifying forward then overwrites with the same
  layers' values.
- "draft_model": a second checkpoint (folder or GGUF) with the target's vocabulary, and its own
  KV cache laid out in the same blocks, so the scheduler's block tables address both. The draft
  catches up on the tokens it has not seen (a whole prompt the first time, the target's corrected
  token after a rejection) before drafting.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from shoal.services.engine.layers.attention import AttentionMetadata
from shoal.services.engine.config import ConfigError
from shoal.services.engine.runner.input_batch import build_model_inputs
from shoal.services.engine.core.outputs import ScheduledSeq, SchedulerOutput
from shoal.services.engine.runner.sampler import SeqState
from shoal.shared.schemas.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from shoal.services.engine.runner.model_runner import ModelRunner

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]
"""(input_ids, positions, meta, logits_indices) -> logits [len(logits_indices), vocab]."""


class DraftProposer:
    def __init__(self, forward: Forward, shares_target_kv: bool, block_size: int,
                 device: torch.device) -> None:
        self.forward = forward
        self.shares_target_kv = shares_target_kv
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def propose(self, seqs: list[ScheduledSeq], states: list[SeqState]) -> list[list[int]]:
        """k greedy drafts per seq: one forward over each seq's unseen tokens (ending with the
        token fed this step), then one single-token forward per further draft."""
        k = max(s.num_spec_tokens for s in seqs)
        drafts: list[list[int]] = [[] for _ in seqs]
        steps: list[ScheduledSeq] = []
        for s, state in zip(seqs, states, strict=True):
            seen = s.start_pos if self.shares_target_kv else min(state.draft_pos, s.start_pos)
            steps.append(ScheduledSeq(s.seq_id, state.token_ids[seen:s.start_pos + 1], seen,
                                      s.block_ids, True, s.prompt_len, s.sampling_params))
        for j in range(k):
            live = [i for i, s in enumerate(seqs) if j < s.num_spec_tokens]
            if not live:
                break
            inputs = build_model_inputs(SchedulerOutput([steps[i] for i in live]),
                                        self.block_size, self.device)
            logits = self.forward(inputs.input_ids, inputs.positions, inputs.meta,
                                  inputs.logits_indices)
            tokens: list[int] = logits.argmax(dim=-1).tolist()
            for i, token in zip(live, tokens, strict=True):
                drafts[i].append(token)
                prev = steps[i]
                steps[i] = ScheduledSeq(prev.seq_id, [token], prev.start_pos + len(prev.token_ids),
                                        prev.block_ids, True, prev.prompt_len,
                                        prev.sampling_params)
        for state, step in zip(states, steps, strict=True):
            state.draft_pos = step.start_pos  # the draft's KV is valid before this position
        return drafts


def first_layers_forward(model: nn.Module, num_layers: int) -> Forward:
    """The target's first num_layers decoder layers, then its final norm and LM head."""
    inner = model.model  # type: ignore[union-attr]

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_indices: torch.Tensor) -> torch.Tensor:
        hidden = inner.embed(input_ids)  # (scaled as the family's: Gemma, Granite)
        residual: torch.Tensor | None = None
        for layer in inner.layers[:num_layers]:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = inner.norm(hidden, residual)
        return model.compute_logits(hidden, logits_indices)  # type: ignore[operator]

    return forward


def whole_model_forward(model: nn.Module) -> Forward:
    def forward(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_indices: torch.Tensor) -> torch.Tensor:
        return model.compute_logits(model(input_ids, positions, meta),  # type: ignore[operator]
                                    logits_indices)

    return forward


def make_draft_proposer(spec: SpeculativeConfig, runner: ModelRunner) -> DraftProposer:
    if spec.method == "layer_skip":
        assert spec.num_draft_layers is not None
        total = len(runner.model.model.layers)  # type: ignore[union-attr]
        if spec.num_draft_layers >= total:
            raise ConfigError(f"num_draft_layers must be below the target's {total} layers, got "
                              f"{spec.num_draft_layers}", param="speculative_config")
        return DraftProposer(first_layers_forward(runner.model, spec.num_draft_layers), True,
                             runner.block_size, runner.device)
    assert spec.model is not None
    return DraftProposer(whole_model_forward(load_draft_model(spec.model, runner)), False,
                         runner.block_size, runner.device)


def load_draft_model(source: str, runner: ModelRunner) -> nn.Module:
    """The draft checkpoint (folder or GGUF, converted like the target), in the target's dtype
    and device, with a KV cache of the target's block count and size."""
    from transformers import AutoConfig

    from shoal.services.engine.runner.kv_cache import bind_kv_caches
    from shoal.services.engine.layers.cpu_weights import gguf_source, prepare_cpu_weights
    from shoal.services.engine.runner.loader import building_in, load_weights
    from shoal.services.engine.model_prep import prepare_model
    from shoal.services.engine.models.registry import model_class

    cache = Path(runner.config.cache_dir) if runner.config.cache_dir else None
    folder = prepare_model(source, cache)
    hf_config = AutoConfig.from_pretrained(folder)
    if hf_config.vocab_size != runner.vocab_size:
        raise ConfigError(f"the draft model's vocabulary ({hf_config.vocab_size}) differs from "
                          f"the target's ({runner.vocab_size}): it must share the tokenizer",
                          param="speculative_config")
    with building_in(runner.dtype, runner.device):  # no float32 copy of the weights first
        model = model_class(hf_config)(hf_config, runner.max_model_len, runner.ops)
    load_weights(model, Path(folder))
    for param in model.parameters():
        param.data = param.data.to(device=runner.device, dtype=runner.dtype)
    model.to(runner.device).eval()
    if runner.device.type == "cpu":
        quantization, draft_gguf = runner.quantization, gguf_source(str(source))
        if quantization == "gguf" and draft_gguf is None:  # a draft given as a folder
            quantization = "int4"
        prepare_cpu_weights(model, quantization, draft_gguf)
    bind_kv_caches(model, runner.num_kv_blocks, runner.block_size, runner.dtype, runner.device)
    return model
