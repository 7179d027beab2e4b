"""AttentionMetadata (one step's KV-cache addressing) and the Attention layer over the paged cache.

The metadata is passed down the forward explicitly (no module-global context, unlike nano-vllm);
each Attention layer holds its own k/v cache tensors, bound once by kv_cache.py, and its own
sliding window (None = full attention), which the kernels apply to absolute positions.

A logit soft-cap (Gemma 2's attn_logit_softcapping) is passed to the op only where a layer has
one; the torch, C++ and Triton ops all apply it. Attention sinks (gpt-oss: a learned logit per
head in the softmax's denominator) likewise: a layer built with `sinks=True` holds them as a
float32 parameter `sinks` of this rank's heads (the checkpoint's `self_attn.sinks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shoal.kernels import Ops, Workspace


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not write
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    workspace: Workspace | None = None  # scratch reused by every layer and step (CPU path)


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 ops: Ops, sliding_window: int | None = None, softcap: float | None = None,
                 sinks: nn.Parameter | None = None) -> None:
        """`sinks`: [num_heads] float32 (this rank's heads), passed to the op on every call."""
        super().__init__()
        self.sinks = sinks
        self.softcap = softcap or None  # scores -> softcap * tanh(scores / softcap)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window  # a query at p sees keys (p - window, p]
        self.ops = ops
        # [num_blocks, block_size, num_kv_heads, head_dim], bound by kv_cache.bind_kv_caches
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        assert self.k_cache.numel(), "KV cache not allocated (kv_cache.bind_kv_caches)"
        self.ops.reshape_and_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        capped: dict = {"softcap": self.softcap} if self.softcap else {}
        if self.sinks is not None:
            capped["sinks"] = self.sinks
        return self.ops.paged_attention(q, self.k_cache, self.v_cache, meta.block_tables,
                                        meta.seq_lens, meta.query_start_loc, self.scale,
                                        self.sliding_window, workspace=meta.workspace, **capped)
