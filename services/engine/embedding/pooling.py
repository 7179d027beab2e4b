"""How an embedding model turns hidden states into one vector: sentence-transformers' own files.

`modules.json` lists the pipeline (Transformer -> Pooling -> Normalize); `1_Pooling/config.json`
says mean or CLS; `sentence_bert_config.json` the longest input. A folder without them is pooled
as vLLM pools a BERT embedding model: CLS, normalised. Torch-free, so the scheduler could read it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.shared.errors import InvalidRequest

EMBEDDING_ARCHITECTURES = frozenset({"BertModel", "BertForMaskedLM", "BertForPreTraining"})
"""BERT-family checkpoints served as embedding models (our encoder in bert.py)."""
CROSS_ENCODER_ARCHITECTURES = frozenset({"BertForSequenceClassification"})
"""BERT cross-encoders (one label): served by the embedding engine for /v1/score and /v1/rerank."""


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    mode: str
    """'mean' (over attended tokens) or 'cls' (the first token)."""
    normalize: bool
    """L2-normalise the pooled vector (a Normalize module in modules.json)."""
    dimension: int
    max_seq_length: int | None
    """sentence_bert_config.json's limit (inputs longer than this are refused or truncated)."""
    matryoshka: bool
    """The model was trained so that a prefix of the vector is an embedding too (`dimensions`)."""


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def is_embedding_model(model_dir: Path) -> bool:
    """A BERT-family encoder (not a causal LM), an embedder or a cross-encoder: served by the
    embedding engine."""
    config = _json(model_dir / "config.json")
    return bool(set(config.get("architectures") or [])
                & (EMBEDDING_ARCHITECTURES | CROSS_ENCODER_ARCHITECTURES))


def is_cross_encoder(config: dict[str, Any]) -> bool:
    """config.json's architectures name a sequence classifier: it scores pairs, not embeds."""
    return bool(set(config.get("architectures") or []) & CROSS_ENCODER_ARCHITECTURES)


def score_activation(config: dict[str, Any]) -> str:
    """'sigmoid' or 'identity' for a one-label cross-encoder's logit, as sentence-transformers'
    CrossEncoder decides: the activation saved in config.json (`sentence_transformers.
    activation_fn`, or the older `sbert_ce_default_activation_function`), else Sigmoid."""
    saved = ((config.get("sentence_transformers") or {}).get("activation_fn")
             or config.get("sbert_ce_default_activation_function") or "Sigmoid")
    name = str(saved).rsplit(".", 1)[-1]
    if name not in ("Sigmoid", "Identity"):
        raise InvalidRequest(f"cross-encoder activation {saved!r} is not supported "
                             "(Sigmoid and Identity are)")
    return name.lower()


def read_pooling(model_dir: Path) -> PoolingConfig:
    config = _json(model_dir / "config.json")
    hidden = int(config["hidden_size"])
    modules = (json.loads((model_dir / "modules.json").read_text())
               if (model_dir / "modules.json").is_file() else None)
    matryoshka = bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions"))
    max_seq = _json(model_dir / "sentence_bert_config.json").get("max_seq_length")
    if modules is None:
        return PoolingConfig("cls", True, hidden, max_seq, matryoshka)
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
    mode = "cls"
    if "Pooling" in types:
        pooling = _json(model_dir / types["Pooling"].get("path", "") / "config.json")
        hidden = int(pooling.get("word_embedding_dimension") or hidden)
        if pooling.get("pooling_mode_mean_tokens"):
            mode = "mean"
        elif not pooling.get("pooling_mode_cls_token"):
            raise InvalidRequest(f"{model_dir}: only mean and CLS pooling are supported")
    unknown = set(types) - {"Transformer", "Pooling", "Normalize"}
    if unknown:
        raise InvalidRequest(f"{model_dir}: sentence-transformers modules {sorted(unknown)} are "
                             "not supported (Transformer, Pooling, Normalize are)")
    return PoolingConfig(mode, "Normalize" in types, hidden, max_seq, matryoshka)
