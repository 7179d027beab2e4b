"""A causal LM's trunk as an encoder (Qwen3-Embedding and other decoder embedders).

The generation engine's own model classes (models/registry.py) and attention kernels run the
forward, so every family the engine generates with (its rope variants, q/k norms, Gemma's
scales) embeds the same way, on the CPU ops or Triton alike; only the LM head is left out. The
paged attention needs a KV cache: a scratch one, big enough for the largest batch seen so far,
is written and read within each forward and never kept (nothing is cached between batches, so
there is no block manager). Each sequence of a packed batch gets its own run of blocks, and the
prefill kernel's causal mask keeps sequences apart.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig

from shoal.kernels import Workspace, select_ops
from shoal.services.engine.embedding.pooling import decoder_architecture
from shoal.services.engine.layers.attention import AttentionMetadata
from shoal.services.engine.models.registry import model_class
from shoal.services.engine.runner.kv_cache import bind_kv_caches
from shoal.services.engine.runner.loader import building_in, load_weights


class DecoderEncoder:
    """`forward_packed` as bert.py's encoder has it: packed token ids -> last hidden states."""

    def __init__(self, model_dir: Path, max_model_len: int, dtype: torch.dtype,
                 device: torch.device, block_size: int) -> None:
        hf = AutoConfig.from_pretrained(model_dir)
        hf.architectures = [decoder_architecture(hf.to_dict())]  # a trunk's: its causal LM's
        self.ops = select_ops(device)
        with building_in(dtype, device):  # no float32 copy of the weights first
            model = model_class(hf)(hf, max_model_len, self.ops)
        model.lm_head = None  # hidden states are the output: no vocabulary projection
        model.skipped_prefixes = (*model.skipped_prefixes, "lm_head.")
        model.bare_checkpoint_prefix = "model."  # type: ignore[attr-defined]
        # (sentence-transformers saves the trunk alone: "layers.0...", not "model.layers.0...")
        load_weights(model, model_dir)
        for param in model.parameters():  # buffers (rotary cos/sin) stay float32
            param.data = param.data.to(device=device, dtype=dtype)
        self.model = model.to(device).eval()
        self.dtype, self.device, self.block_size = dtype, device, block_size
        self.num_blocks = 0
        self.workspace = Workspace()

    def _reserve(self, blocks: int) -> None:
        """Grow the scratch cache to hold `blocks` (a larger batch than any before)."""
        if blocks > self.num_blocks:
            bind_kv_caches(self.model, blocks, self.block_size, self.dtype, self.device)
            self.num_blocks = blocks

    def forward_packed(self, ids: torch.Tensor, positions: torch.Tensor,
                       seq_lens: list[int], token_types: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """`[num_tokens]` ids of the sequences in `seq_lens`, one after another ->
        `[num_tokens, hidden]` final-norm hidden states (causal attention within each)."""
        bs = self.block_size
        counts = [-(-n // bs) for n in seq_lens]
        self._reserve(sum(counts))
        tables = torch.zeros(len(seq_lens), max(counts), dtype=torch.int32)
        slots, first = [], 0
        for i, (n, c) in enumerate(zip(seq_lens, counts)):
            blocks = torch.arange(first, first + c, dtype=torch.int32)
            tables[i, :c] = blocks
            slots.append(first * bs + torch.arange(n))  # a sequence's blocks are contiguous
            first += c
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(self.device),
            block_tables=tables.to(self.device), seq_lens=lens.to(self.device),
            query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int32),
                                       lens.cumsum(0, dtype=torch.int32)]).to(self.device),
            workspace=self.workspace)
        return self.model(ids, positions, meta)
