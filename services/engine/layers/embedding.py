"""Token embedding and the LM head, which computes logits only at the rows that are sampled."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shoal.services.engine.layers.linear import default_weight_loader


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [.., hidden]
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None) -> None:
        super().__init__()
        if tied_to is not None:  # shares the embedding's parameter: the checkpoint has one copy
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
            self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.kernel: Callable[[torch.Tensor], torch.Tensor] | None = None
        """The weight prepared for a faster CPU kernel after loading (a copy when tied)."""

    def forward(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """hidden [num_tokens, hidden], logits_indices [num_logits] -> [num_logits, vocab] fp32."""
        if logits_indices.shape[0] != hidden.shape[0]:
            hidden = hidden.index_select(0, logits_indices)
        if self.kernel is not None:
            return self.kernel(hidden).float()
        return F.linear(hidden, self.weight).float()
