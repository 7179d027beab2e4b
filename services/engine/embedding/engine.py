"""EmbeddingEngine: texts or token ids -> pooled, normalised vectors, in packed batches.

Offline and synchronous (the benchmark and the parity test call it directly); the serving path
wraps it in AsyncEmbeddingEngine (async_engine.py). A batch is packed (the inputs' tokens in one
row, attention per input: bert.py), bounded by the engine's `max_num_seqs` inputs and
`max_num_batched_tokens` tokens, as generation's steps are; nothing is padded, so inputs of any
lengths batch together at the cost of their own tokens.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from shoal.services.engine.runner.cpu_threads import cpu_threads
from shoal.services.engine.config import ENGINE_DEFAULTS, ConfigError, EngineConfig
from shoal.services.engine.embedding.bert import (
    BertModel, BertScoreHead, RobertaScoreHead, position_offset
)
from shoal.services.engine.embedding.decoder import DecoderEncoder
from shoal.services.engine.embedding.pooling import (
    is_cross_encoder, is_decoder, read_pooling, score_activation
)
from shoal.services.engine.input_processor import InputProcessor
from shoal.services.engine.model_limits import context_limit, resolve_max_model_len
from shoal.shared.errors import InvalidRequest

log = logging.getLogger(__name__)
ScoreHead = BertScoreHead | RobertaScoreHead


def _load_bert(model_dir: Path, dtype: torch.dtype, device: torch.device
               ) -> tuple[BertModel, ScoreHead | None, Any]:
    """The encoder, and a cross-encoder's score head (BERT's pooler + one-label classifier,
    or (XLM-)RoBERTa's classifier)."""
    raw = json.loads((model_dir / "config.json").read_text())
    cfg = SimpleNamespace(**{"type_vocab_size": 2, "layer_norm_eps": 1e-12, "hidden_act": "gelu",
                             **raw})
    model = BertModel(cfg)
    roberta = position_offset(cfg) > 0
    head: ScoreHead | None = None
    if is_cross_encoder(raw):
        head = RobertaScoreHead(cfg) if roberta else BertScoreHead(cfg)
    if head is not None and len(raw.get("id2label") or {"0": ""}) != 1:
        raise ConfigError(f"{model_dir}: a cross-encoder must have one label (num_labels=1)")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir} has no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    head_state: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            name = name.removeprefix("bert.").removeprefix("roberta.")
            if name.startswith(("embeddings.", "encoder.")) and not name.endswith("position_ids"):
                state[name] = tensor
            elif name.startswith(("pooler.", "classifier.")):
                head_state[name] = tensor
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(f"checkpoint in {model_dir} does not match BERT: missing "
                          f"{missing[:5]}, unexpected {unexpected[:5]}")
    if head is not None:
        missing, unexpected = head.load_state_dict(head_state, strict=False)
        if missing or unexpected:
            raise ConfigError(f"checkpoint in {model_dir} has no one-label classifier: missing "
                              f"{missing[:5]}, unexpected {unexpected[:5]}")
        head = head.to(device=device, dtype=dtype).eval()
    return model.to(device=device, dtype=dtype).eval(), head, cfg


class EmbeddingEngine:
    def __init__(self, config: EngineConfig, model_dir: Path | None = None) -> None:
        from transformers import AutoTokenizer

        if model_dir is None:
            from shoal.services.engine.model_prep import prepare_model

            model_dir = prepare_model(config.model, Path(config.cache_dir) if config.cache_dir
                                      else None)
        self.config = config
        self.model_dir = Path(model_dir)
        self.device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                                   if config.device == "auto" else config.device)
        if config.num_threads or self.device.type == "cpu":
            # the generation engine's rule (model_runner.py)
            torch.set_num_threads(cpu_threads(config.num_threads)[0])
        self.dtype = getattr(torch, ENGINE_DEFAULTS.dtype(config.dtype, self.device.type))
        self.pooling = read_pooling(self.model_dir, config.override_pooler_config)
        raw = json.loads((self.model_dir / "config.json").read_text())
        limit = context_limit(raw)
        if position_offset(SimpleNamespace(**raw)):  # RoBERTa: the first positions are unused
            limit = replace(limit, max_model_len=limit.max_model_len
                            - position_offset(SimpleNamespace(**raw)))
        self.max_model_len: int = (
            resolve_max_model_len(config.max_model_len, limit) if config.max_model_len else
            min(self.pooling.max_seq_length or limit.max_model_len, limit.max_model_len))
        self.model: BertModel | DecoderEncoder
        self.score_head: ScoreHead | None = None
        if is_decoder(raw):  # a causal LM as an embedder: the generation engine's model code
            self.model = DecoderEncoder(self.model_dir, self.max_model_len, self.dtype,
                                        self.device, config.block_size)
            hf = SimpleNamespace(**raw)
        else:
            self.model, self.score_head, hf = _load_bert(self.model_dir, self.dtype, self.device)
        self.one_type = getattr(hf, "type_vocab_size", 2) == 1
        self.activation = score_activation(vars(hf)) if self.score_head is not None else None
        """A cross-encoder's: 'sigmoid' or 'identity' on its logit (None: an embedder)."""
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.vocab_size: int = hf.vocab_size
        self.inputs = InputProcessor(tokenizer=self.tokenizer, max_model_len=self.max_model_len,
                                     vocab_size=self.vocab_size)
        """Texts and token ids as checked inputs (input_processor.py, every front end's)."""
        self.dimension = self.pooling.dimension
        log.info("embedding engine: %s, %s, max %d tokens, %s %s", self.model_dir.name,
                 f"cross-encoder ({self.activation})" if self.score_head is not None else
                 f"{self.pooling.mode} pooling{' + normalize' if self.pooling.normalize else ''}"
                 f", {self.dimension} dims", self.max_model_len, self.device, self.dtype)

    # ------------------------------------------------------------------ inputs
    def check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None or dimensions == self.dimension:
            return
        if not self.pooling.matryoshka:
            raise InvalidRequest(f"this model's embeddings have {self.dimension} dimensions and "
                                 "it does not support other `dimensions` (not a Matryoshka model)",
                                 param="dimensions")
        if not 1 <= dimensions <= self.dimension:
            raise InvalidRequest(f"dimensions must be in [1, {self.dimension}]",
                                 param="dimensions")

    # ------------------------------------------------------------------ compute
    def batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """Indexes grouped into packed batches, in order: each within max_num_seqs inputs and
        max_num_batched_tokens tokens (a lone input over the budget runs alone). Packed, a
        batch costs its real tokens, so no sorting by length is needed."""
        out: list[list[int]] = []
        tokens = 0
        for i, n in enumerate(lengths):
            cur = out[-1] if out else None
            if (cur is not None and len(cur) < self.config.max_num_seqs
                    and tokens + n <= self.config.max_num_batched_tokens):
                cur.append(i)
                tokens += n
            else:
                out.append([i])
                tokens = n
        return out

    @torch.inference_mode()
    def embed(self, batch: Sequence[Sequence[int]], dimensions: int | None = None) -> torch.Tensor:
        """Pooled (normalised) float32 vectors `[len(batch), dimensions or dim]`, on the CPU."""
        result = torch.empty(len(batch), self.dimension, dtype=torch.float32)
        for group in self.batches([len(ids) for ids in batch]):
            seq_lens = [len(batch[i]) for i in group]
            ids = torch.tensor([t for i in group for t in batch[i]], dtype=torch.long)
            positions = torch.cat([torch.arange(n) for n in seq_lens])
            hidden = self.model.forward_packed(ids.to(self.device), positions.to(self.device),
                                               seq_lens).float()
            result[group] = self._pool(hidden, seq_lens).cpu()
        if dimensions is not None and dimensions < self.dimension:
            result = result[:, :dimensions]  # Matryoshka: a prefix, normalised again below
        if self.pooling.normalize:
            result = F.normalize(result, p=2, dim=1)
        return result

    @torch.inference_mode()
    def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> torch.Tensor:
        """A cross-encoder's float32 scores `[len(pairs)]` (CPU) for (token ids, token types)
        pairs: the [CLS] state through the pooler and classifier, then the activation."""
        if self.score_head is None:
            raise InvalidRequest(f"model {self.config.model} is an embedding model, not a "
                                 "cross-encoder: it serves /v1/embeddings, not scores",
                                 param="model", code="wrong_model_type")
        result = torch.empty(len(pairs), dtype=torch.float32)
        for group in self.batches([len(ids) for ids, _ in pairs]):
            seq_lens = [len(pairs[i][0]) for i in group]
            ids = torch.tensor([t for i in group for t in pairs[i][0]], dtype=torch.long)
            types = torch.tensor([t for i in group for t in pairs[i][1]], dtype=torch.long)
            if self.one_type:  # (XLM-)RoBERTa: one token type, whatever the tokenizer says
                types.zero_()
            positions = torch.cat([torch.arange(n) for n in seq_lens])
            hidden = self.model.forward_packed(ids.to(self.device), positions.to(self.device),
                                               seq_lens, types.to(self.device))
            starts = torch.tensor([0] + seq_lens[:-1]).cumsum(0).to(hidden.device)
            result[group] = self.score_head(hidden[starts]).float().cpu()
        return torch.sigmoid(result) if self.activation == "sigmoid" else result

    def _pool(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """One vector per packed sequence: its first token (CLS), its last token (a causal LM's:
        packed, nothing is padded, so left or right padding does not arise) or the mean of its
        tokens."""
        if self.pooling.mode == "cls":
            starts = torch.tensor([0] + seq_lens[:-1]).cumsum(0).to(hidden.device)
            return hidden[starts]
        if self.pooling.mode == "last":
            ends = torch.tensor(seq_lens).cumsum(0).to(hidden.device) - 1
            return hidden[ends]
        return torch.stack([part.mean(0) for part in hidden.split(seq_lens)])

    def score_texts(self, text_1: Sequence[str], text_2: Sequence[str]) -> torch.Tensor:
        """Text pairs -> scores (the offline shortcut: tokenize as pairs, check, score)."""
        pairs = self.inputs.pair_inputs(text_1, text_2)
        self.inputs.check_embedding_inputs([ids for ids, _ in pairs])
        return self.score(pairs)

    def encode(self, texts: Sequence[str], dimensions: int | None = None) -> torch.Tensor:
        """Texts -> vectors (the offline shortcut: tokenize, check, embed)."""
        ids = self.inputs.embedding_inputs(texts)
        self.inputs.check_embedding_inputs(ids)
        self.check_dimensions(dimensions)
        return self.embed(ids, dimensions)
