"""Profile of a Hugging Face folder: config.json for the shape, safetensors headers for the size.

A safetensors file starts with an 8-byte little-endian header length and a JSON header that lists
every tensor's dtype and shape: that is all we read. Without weight files the parameter count is
estimated from the shape (a Llama-style decoder), so a config-only folder can be planned.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from shoal.services.scheduler.claim.profile import ModelProfile, ModelShape
from shoal.shared.errors import InvalidRequest

MAX_HEADER_BYTES = 100 * 1024 * 1024
_TORCH_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
                      "I8": "int8", "U8": "uint8", "I32": "int32", "I64": "int64",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "I32": 4,
                "I64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def shape_from_config(config: dict[str, Any]) -> ModelShape:
    """The shape fields of a transformers config.json (Llama, Mistral, Qwen, BERT and kin)."""
    text = config.get("text_config")
    if isinstance(text, dict):  # multimodal wrappers keep the language model under text_config
        config = {**config, **text}
    architectures = config.get("architectures") or [config.get("model_type", "unknown")]
    architecture = str(architectures[0])
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
    except KeyError as exc:
        raise InvalidRequest(f"config.json lacks {exc.args[0]}: cannot size the model") from exc
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    return ModelShape(
        architecture=architecture, num_layers=layers, hidden_size=hidden,
        num_attention_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=int(config.get("intermediate_size") or 4 * hidden),
        vocab_size=int(config.get("vocab_size") or 32000),
        max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
        is_causal_lm=architecture.endswith(("ForCausalLM", "LMHeadModel",
                                            "ForConditionalGeneration")),
    )


def estimate_num_params(shape: ModelShape, tied_embeddings: bool) -> int:
    """Parameters of a Llama-style decoder (gated MLP, GQA) of this shape."""
    h, hd = shape.hidden_size, shape.head_dim
    attention = h * shape.num_attention_heads * hd * 2 + h * shape.num_kv_heads * hd * 2
    mlp = 3 * h * shape.intermediate_size
    per_layer = attention + mlp + 2 * h
    embeddings = shape.vocab_size * h * (1 if tied_embeddings else 2)
    return shape.num_layers * per_layer + embeddings + h


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of one .safetensors file (reads 8 + header-length bytes)."""
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise InvalidRequest(f"{path} is too short to be a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise InvalidRequest(f"{path}: safetensors header of {length} bytes is implausible")
        header: dict[str, Any] = json.loads(f.read(length))
    return header


def read_hf_profile(folder: Path) -> ModelProfile:
    config = json.loads((folder / "config.json").read_text())
    shape = shape_from_config(config)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        tied = bool(config.get("tie_word_embeddings", False))
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
        return ModelProfile(source=str(folder), format="config", shape=shape,
                            num_params=estimate_num_params(shape, tied), file_bytes=0,
                            checkpoint_dtype=dtype)
    num_params = file_bytes = 0
    dtype_bytes: dict[str, int] = {}
    for file in files:
        for name, info in read_safetensors_header(file).items():
            if name == "__metadata__":
                continue
            count = math.prod(int(d) for d in info["shape"])
            start, end = info["data_offsets"]
            num_params += count
            file_bytes += int(end) - int(start)
            dtype_bytes[info["dtype"]] = dtype_bytes.get(info["dtype"], 0) + int(end) - int(start)
    main = max(dtype_bytes, key=lambda d: dtype_bytes[d]) if dtype_bytes else "F32"
    return ModelProfile(source=str(folder), format="safetensors", shape=shape,
                        num_params=num_params, file_bytes=file_bytes,
                        checkpoint_dtype=_TORCH_DTYPE_NAMES.get(main, main.lower()))
