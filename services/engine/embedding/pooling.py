"""How an embedding model turns hidden states into one vector: sentence-transformers' own files.

`modules.json` lists the pipeline (Transformer -> Pooling -> Normalize); `1_Pooling/config.json`
says mean, CLS or last token; `sentence_bert_config.json` the longest input. A folder without
them is pooled as vLLM pools it: a BERT embedding model by CLS, a causal LM served as an embedder
(`task="embed"`) by its last token, both normalised; vLLM's `override_pooler_config` overrides
either. Torch-free, so the scheduler could read it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.shared.errors import InvalidRequest

EMBEDDING_ARCHITECTURES = frozenset({"BertModel", "BertForMaskedLM", "BertForPreTraining"})
"""BERT-family checkpoints served as embedding models (our encoder in bert.py)."""
CROSS_ENCODER_ARCHITECTURES = frozenset({"BertForSequenceClassification",
                                         "XLMRobertaForSequenceClassification",
                                         "RobertaForSequenceClassification"})
"""BERT and (XLM-)RoBERTa cross-encoders (one label; bge-reranker is XLM-RoBERTa): served by the
embedding engine for /v1/score and /v1/rerank."""


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    mode: str
    """'mean' (over attended tokens), 'cls' (the first token) or 'last' (the last token: a
    causal LM's only state that saw the whole input)."""
    normalize: bool
    """L2-normalise the pooled vector (a Normalize module in modules.json)."""
    dimension: int
    max_seq_length: int | None
    """sentence_bert_config.json's limit (inputs longer than this are refused or truncated)."""
    matryoshka: bool
    """The model was trained so that a prefix of the vector is an embedding too (`dimensions`)."""


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


DECODER_TRUNKS = {f"{family}Model": f"{family}ForCausalLM" for family in (
    "Llama", "Mistral", "Qwen2", "Qwen3", "Gemma2", "Phi3", "Granite")}
"""A causal LM's trunk saved alone (sentence-transformers saves Qwen3-Embedding as Qwen3Model)
-> the causal LM class whose `model` it is."""


def decoder_architecture(config: dict[str, Any]) -> str | None:
    """The causal LM class config.json names (a trunk's mapped by DECODER_TRUNKS): run by the
    generation engine's model classes. None: not a decoder."""
    for arch in config.get("architectures") or []:
        if str(arch).endswith("ForCausalLM"):
            return str(arch)
        if arch in DECODER_TRUNKS:
            return DECODER_TRUNKS[arch]
    return None


def is_decoder(config: dict[str, Any]) -> bool:
    return decoder_architecture(config) is not None


def _pooling_module(model_dir: Path) -> dict[str, Any] | None:
    """sentence-transformers' Pooling module config (1_Pooling/config.json), if the folder has
    one."""
    if not (model_dir / "modules.json").is_file():
        return None
    for module in json.loads((model_dir / "modules.json").read_text()):
        if str(module.get("type", "")).rsplit(".", 1)[-1] == "Pooling":
            return _json(model_dir / module.get("path", "") / "config.json")
    return None


def is_embedding_model(model_dir: Path, task: str = "auto") -> bool:
    """Served by the embedding engine: a BERT-family encoder (an embedder or a cross-encoder),
    or a causal LM asked to embed (`task="embed"`, vLLM's --task embed) or saved with
    sentence-transformers' pooling files (Qwen3-Embedding) under task "auto"."""
    config = _json(model_dir / "config.json")
    if set(config.get("architectures") or []) & (EMBEDDING_ARCHITECTURES
                                                 | CROSS_ENCODER_ARCHITECTURES):
        return True
    if not is_decoder(config) or task == "generate":
        return False
    return task == "embed" or _pooling_module(model_dir) is not None


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


def read_pooling(model_dir: Path, override: dict[str, Any] | None = None) -> PoolingConfig:
    """The folder's pooling, then `override` (vLLM's override_pooler_config: pooling_type
    LAST / MEAN / CLS, normalize) on top."""
    config = _json(model_dir / "config.json")
    pooling = _folder_pooling(model_dir, config)
    if not override:
        return pooling
    mode = str(override.get("pooling_type") or pooling.mode).lower()
    return PoolingConfig(mode, bool(override.get("normalize", pooling.normalize)),
                         pooling.dimension, pooling.max_seq_length, pooling.matryoshka)


def _folder_pooling(model_dir: Path, config: dict[str, Any]) -> PoolingConfig:
    hidden = int(config["hidden_size"])
    modules = (json.loads((model_dir / "modules.json").read_text())
               if (model_dir / "modules.json").is_file() else None)
    matryoshka = bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions"))
    max_seq = _json(model_dir / "sentence_bert_config.json").get("max_seq_length")
    default = "last" if is_decoder(config) else "cls"
    if modules is None:
        return PoolingConfig(default, True, hidden, max_seq, matryoshka)
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
    mode = default
    if "Pooling" in types:
        pooling = _json(model_dir / types["Pooling"].get("path", "") / "config.json")
        hidden = int(pooling.get("word_embedding_dimension")
                     or pooling.get("embedding_dimension") or hidden)
        named = pooling.get("pooling_mode")  # sentence-transformers 6 names the mode
        if named == "mean" or pooling.get("pooling_mode_mean_tokens"):
            mode = "mean"
        elif named == "lasttoken" or pooling.get("pooling_mode_lasttoken"):
            mode = "last"
        elif named == "cls" or pooling.get("pooling_mode_cls_token"):
            mode = "cls"
        else:
            raise InvalidRequest(f"{model_dir}: only mean, CLS and last-token pooling are "
                                 "supported")
    unknown = set(types) - {"Transformer", "Pooling", "Normalize"}
    if unknown:
        raise InvalidRequest(f"{model_dir}: sentence-transformers modules {sorted(unknown)} are "
                             "not supported (Transformer, Pooling, Normalize are)")
    return PoolingConfig(mode, "Normalize" in types, hidden, max_seq, matryoshka)
