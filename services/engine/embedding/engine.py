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
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from shoal.services.engine.runner.cpu_threads import cpu_threads
from shoal.services.engine.config import ENGINE_DEFAULTS, ConfigError, EngineConfig
from shoal.services.engine.embedding.bert import BertModel
from shoal.services.engine.embedding.pooling import read_pooling
from shoal.services.engine.input_processor import InputProcessor
from shoal.services.engine.model_limits import context_limit, resolve_max_model_len
from shoal.shared.errors import InvalidRequest

log = logging.getLogger(__name__)


def _load_bert(model_dir: Path, dtype: torch.dtype, device: torch.device) -> tuple[BertModel, Any]:
    cfg = SimpleNamespace(**{"type_vocab_size": 2, "layer_norm_eps": 1e-12, "hidden_act": "gelu",
                             **json.loads((model_dir / "config.json").read_text())})
    model = BertModel(cfg)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir} has no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            name = name.removeprefix("bert.")
            if name.startswith(("embeddings.", "encoder.")) and not name.endswith("position_ids"):
                state[name] = tensor
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(f"checkpoint in {model_dir} does not match BERT: missing "
                          f"{missing[:5]}, unexpected {unexpected[:5]}")
    return model.to(device=device, dtype=dtype).eval(), cfg


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
        self.pooling = read_pooling(self.model_dir)
        self.model, hf = _load_bert(self.model_dir, self.dtype, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        limit = context_limit(vars(hf))  # the config.json fields (a SimpleNamespace)
        self.max_model_len: int = (
            resolve_max_model_len(config.max_model_len, limit) if config.max_model_len else
            min(self.pooling.max_seq_length or limit.max_model_len, limit.max_model_len))
        self.vocab_size: int = hf.vocab_size
        self.inputs = InputProcessor(tokenizer=self.tokenizer, max_model_len=self.max_model_len,
                                     vocab_size=self.vocab_size)
        """Texts and token ids as checked inputs (input_processor.py, every front end's)."""
        self.dimension = self.pooling.dimension
        log.info("embedding engine: %s, %s pooling%s, %d dims, max %d tokens, %s %s",
                 self.model_dir.name, self.pooling.mode,
                 " + normalize" if self.pooling.normalize else "", self.dimension,
                 self.max_model_len, self.device, self.dtype)

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

    def _pool(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """One vector per packed sequence: its first token (CLS) or the mean of its tokens."""
        if self.pooling.mode == "cls":
            starts = torch.tensor([0] + seq_lens[:-1]).cumsum(0).to(hidden.device)
            return hidden[starts]
        return torch.stack([part.mean(0) for part in hidden.split(seq_lens)])

    def encode(self, texts: Sequence[str], dimensions: int | None = None) -> torch.Tensor:
        """Texts -> vectors (the offline shortcut: tokenize, check, embed)."""
        ids = self.inputs.embedding_inputs(texts)
        self.inputs.check_embedding_inputs(ids)
        self.check_dimensions(dimensions)
        return self.embed(ids, dimensions)
