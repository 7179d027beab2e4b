"""Token embedding and the LM head, which computes logits only at the rows that are sampled.

Vocab-parallel under tensor parallelism (vLLM's VocabParallelEmbedding / ParallelLMHead): each tp
rank holds ceil(vocab / tp) rows (the last rank's tail zero-padded); the embedding looks up the ids
in its range and an all-reduce sums the ranks' rows, the LM head's logit shards are all-gathered.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shoal.services.engine.distributed.parallel_state import ParallelContext


class _VocabShard:
    """This rank's rows of a [vocab, hidden] weight: [start, start + rows), rows = ceil(V / tp)."""

    def __init__(self, vocab_size: int, parallel: ParallelContext | None) -> None:
        self.parallel = parallel or ParallelContext.single()
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // self.parallel.tp_size)
        self.start = self.parallel.tp_rank * self.rows

    def new_weight(self, hidden_size: int) -> nn.Parameter:
        weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)
        weight.weight_loader = self.load  # type: ignore[attr-defined]
        return weight

    def load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        assert loaded.shape == (self.vocab_size, param.shape[1]), (tuple(loaded.shape),
                                                                   tuple(param.shape))
        count = max(0, min(self.rows, self.vocab_size - self.start))
        param.data.zero_()
        param.data[:count].copy_(loaded[self.start:self.start + count])


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int,
                 parallel: ParallelContext | None = None) -> None:
        super().__init__()
        self.shard = _VocabShard(vocab_size, parallel)
        self.weight = self.shard.new_weight(hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [.., hidden]
        p = self.shard.parallel
        if p.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.rows)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside[:, None], 0.0)
        return p.all_reduce(hidden)


class LMHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None,
                 parallel: ParallelContext | None = None) -> None:
        super().__init__()
        self.shard = _VocabShard(vocab_size, parallel)
        if tied_to is not None:  # shares the embedding's parameter: the checkpoint has one copy
            self.weight = tied_to.weight
        else:
            self.weight = self.shard.new_weight(hidden_size)
        self.kernel: Callable[[torch.Tensor], torch.Tensor] | None = None
        """The weight prepared for a faster CPU kernel after loading (a copy when tied)."""

    def forward(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """hidden [num_tokens, hidden], logits_indices [num_logits] -> [num_logits, vocab] fp32."""
        if logits_indices.shape[0] != hidden.shape[0]:
            hidden = hidden.index_select(0, logits_indices)
        logits = self.kernel(hidden) if self.kernel is not None else F.linear(hidden, self.weight)
        if self.shard.parallel.tp_size > 1:
            logits = self.shard.parallel.all_gather_last_dim(logits)[:, :self.shard.vocab_size]
        return logits.float()
