"""Profile of a .gguf file: architecture metadata and tensor element counts, nothing dequantised.

Our engine runs GGUF weights dequantised (transformers converts them to dense tensors), so what
counts is the element count, not the quantised bytes on disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shoal.services.engine import ENGINE_DEFAULTS, ContextLimit
from shoal.services.scheduler.claim.profile import ModelProfile, ModelShape
from shoal.shared.errors import InvalidRequest


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    return field.contents()


def read_gguf_profile(path: Path) -> ModelProfile:
    """The profile of a .gguf file; a header that cannot be parsed, whatever the gguf package
    raises on it (a crafted file gives ValueError, IndexError, numpy errors...), is an
    InvalidRequest naming `source`."""
    try:
        return _read(path)
    except InvalidRequest:
        raise
    except Exception as exc:  # noqa: BLE001 - any flaw of the header is a bad source
        raise InvalidRequest(f"{path} is not a readable GGUF file: {type(exc).__name__}: {exc}",
                             param="source") from None


def _read(path: Path) -> ModelProfile:
    from gguf import GGUFReader  # the gguf package parses headers over a memory map

    reader = GGUFReader(str(path), "r")
    arch = str(_field(reader, "general.architecture") or "llama")

    def meta(name: str) -> int | None:
        value = _field(reader, f"{arch}.{name}")
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidRequest(f"{path}: GGUF metadata {arch}.{name} must be a number, got "
                                 f"{value!r}", param="source")
        return int(value)

    layers = meta("block_count")
    hidden = meta("embedding_length")
    heads = meta("attention.head_count")
    if not layers or not hidden or not heads:
        raise InvalidRequest(f"{path}: GGUF metadata lacks {arch}.block_count/embedding_length/"
                             "attention.head_count", param="source")
    vocab = meta("vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else 32000
    context = meta("context_length") or ENGINE_DEFAULTS.max_model_len_fallback
    shape = ModelShape(
        architecture=f"{arch.capitalize()}ForCausalLM", num_layers=layers, hidden_size=hidden,
        num_attention_heads=heads, num_kv_heads=meta("attention.head_count_kv") or heads,
        head_dim=meta("attention.key_length") or hidden // heads,
        intermediate_size=meta("feed_forward_length") or 4 * hidden, vocab_size=vocab,
        max_position_embeddings=context,
        context=ContextLimit(context, f"{arch}.context_length={context} in the GGUF metadata, "
                                      "the converted config's max_position_embeddings"),
    )
    num_params = sum(int(t.n_elements) for t in reader.tensors)
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    kinds: dict[str, int] = {}
    for t in reader.tensors:
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + int(t.n_bytes)
    main = max(kinds, key=lambda k: kinds[k]).lower() if kinds else "unknown"
    return ModelProfile(source=str(path), format="gguf", shape=shape, num_params=num_params,
                        file_bytes=file_bytes, checkpoint_dtype=main)
