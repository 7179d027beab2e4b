"""A BERT encoder (BertModel: embeddings, post-norm layers, no pooler), our own code; RoBERTa and
XLM-RoBERTa are the same encoder with positions counted from `pad_token_id + 1` (their
embeddings' `position_offset`) and one token type.

Module names are transformers' (`embeddings.word_embeddings`, `encoder.layer.N.attention.self.
query`, ...) so a checkpoint's state dict loads as is. The engine runs a batch packed, as vLLM
runs an encoder: the sequences' tokens flattened into one `[num_tokens]` row (no padding, so
every matmul costs only real tokens) and attention computed per sequence with torch's
scaled_dot_product_attention. `forward` (padded, with a mask) is the plain reference form.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


ROBERTA_TYPES = frozenset({"roberta", "xlm-roberta"})


def position_offset(cfg: Any) -> int:
    """Where a sequence's positions start in the position table: RoBERTa's count from
    padding_idx + 1 (transformers' create_position_ids_from_input_ids), BERT's from 0."""
    if getattr(cfg, "model_type", None) in ROBERTA_TYPES:
        return int(getattr(cfg, "pad_token_id", 1)) + 1
    return 0


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.position_offset = position_offset(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                token_types: torch.Tensor | None = None) -> torch.Tensor:
        """`[batch, seq]` ids (positions 0..seq-1), or packed `[num_tokens]` ids with each
        token's position in its sequence; token types (a pair's segments) default to 0."""
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
        types = (self.token_type_embeddings.weight[0] if token_types is None
                 else self.token_type_embeddings(token_types))
        if self.position_offset:
            positions = positions + self.position_offset
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + types
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [b, s, h] -> [b, heads, s, head_dim]
            return t.view(b, s, self.num_heads, h // self.num_heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.query(x)), heads(self.key(x)),
                                             heads(self.value(x)), attn_mask=mask)
        return out.transpose(1, 2).reshape(b, s, h)


    def forward_packed(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """x `[num_tokens, hidden]`, the sequences one after another; attention within each."""
        h = x.shape[1]
        head_dim = h // self.num_heads
        outs = []
        for q, k, v in zip(self.query(x).split(seq_lens), self.key(x).split(seq_lens),
                           self.value(x).split(seq_lens)):
            n = q.shape[0]

            def heads(t: torch.Tensor, n: int = n) -> torch.Tensor:  # [n, h] -> [1, heads, n, d]
                return t.view(1, n, self.num_heads, head_dim).transpose(1, 2)

            out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v))
            outs.append(out.transpose(1, 2).reshape(n, h))
        return torch.cat(outs)


class BertDenseNorm(nn.Module):
    """dense -> (+ residual) -> LayerNorm: BertSelfOutput and BertOutput."""

    def __init__(self, cfg: Any, in_features: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertDenseNorm(cfg, cfg.hidden_size)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = ACTIVATIONS[cfg.hidden_act]


class BertLayer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertDenseNorm(cfg, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attention.output(self.attention.self(x, mask), x)
        inner = self.intermediate.act(self.intermediate.dense(x))
        return self.output(inner, x)

    def forward_packed(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        x = self.attention.output(self.attention.self.forward_packed(x, seq_lens), x)
        inner = self.intermediate.act(self.intermediate.dense(x))
        return self.output(inner, x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))


class BertModel(nn.Module):
    """Token ids `[batch, seq]` and a 0/1 mask -> last hidden states `[batch, seq, hidden]`."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported")
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(input_ids)
        # a boolean mask over keys (True = attend): SDPA's cheaper form than an additive one
        mask = attention_mask.bool()[:, None, None, :]
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x

    def forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       seq_lens: list[int], token_types: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """Packed `[num_tokens]` ids, positions within each sequence, and the sequences' lengths
        -> last hidden states `[num_tokens, hidden]`."""
        x = self.embeddings(input_ids, positions, token_types)
        for layer in self.encoder.layer:
            x = layer.forward_packed(x, seq_lens)
        return x


class BertScoreHead(nn.Module):
    """BertForSequenceClassification's head with one label (a cross-encoder): the pooler
    (tanh(dense(CLS))) then `classifier` -> one logit per sequence. Names as transformers'
    (`pooler.dense`, `classifier`) so the checkpoint loads as is."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.pooler = nn.Module()
        self.pooler.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.classifier = nn.Linear(cfg.hidden_size, 1)

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """`[n, hidden]` first-token states -> `[n]` logits."""
        return self.classifier(torch.tanh(self.pooler.dense(cls_hidden))).squeeze(-1)


class RobertaScoreHead(nn.Module):
    """(XLM-)RobertaForSequenceClassification's head with one label: `classifier.dense`, tanh,
    `classifier.out_proj` on the first token's (<s>) state; no pooler."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.classifier = nn.Module()
        self.classifier.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.classifier.out_proj = nn.Linear(cfg.hidden_size, 1)

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """`[n, hidden]` first-token states -> `[n]` logits."""
        head = self.classifier
        return head.out_proj(torch.tanh(head.dense(cls_hidden))).squeeze(-1)
