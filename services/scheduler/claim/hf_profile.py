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

from shoal.services.engine import ENGINE_DEFAULTS, context_limit
from shoal.services.scheduler.claim.profile import ModelProfile, ModelShape
from shoal.shared.errors import InvalidRequest

MAX_HEADER_BYTES = 100 * 1024 * 1024
_TORCH_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
                      "MXFP4": "mxfp4", "I8": "int8", "U8": "uint8", "I32": "int32", "I64": "int64",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "I32": 4,
                "I64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
              type(None): "null"}


def read_config(path: Path) -> dict[str, Any]:
    """A config.json as a dict, or InvalidRequest (param `source`) saying what is wrong with it."""
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise InvalidRequest(f"cannot read {path}: {exc.strerror or exc}", param="source") from None
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"{path} is not UTF-8 text: {exc}", param="source") from None
    return json_object(text, path)


def json_object(text: str | bytes, path: Path) -> dict[str, Any]:
    """`text` parsed as one JSON object; InvalidRequest naming `path` and the flaw otherwise."""
    try:
        value = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise InvalidRequest(f"{path} is not valid JSON: {exc}", param="source") from None
    if not isinstance(value, dict):
        kind = JSON_TYPES.get(type(value), type(value).__name__)
        raise InvalidRequest(f"{path} is a JSON {kind}, not an object", param="source")
    return value


def _count(config: dict[str, Any], key: str, default: int | None = None) -> int:
    """A positive integer field of config.json (`default` when absent or null)."""
    value = config.get(key)
    if value is None:
        if default is None:
            raise InvalidRequest(f"config.json lacks {key}: cannot size the model",
                                 param="source")
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidRequest(f"config.json: {key} must be a positive integer, got {value!r}",
                             param="source")
    return value


def _architecture(config: dict[str, Any]) -> str:
    names = config.get("architectures")
    if names is None or names == []:
        return str(config.get("model_type") or "unknown")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise InvalidRequest(f"config.json: architectures must be a list of class names, got "
                             f"{names!r}", param="source")
    return names[0]


def shape_from_config(config: dict[str, Any]) -> ModelShape:
    """The shape fields of a transformers config.json (Llama, Mistral, Qwen, BERT and kin); any
    field that is missing or not a positive integer is an InvalidRequest naming it."""
    text = config.get("text_config")
    if isinstance(text, dict):  # multimodal wrappers keep the language model under text_config
        config = {**config, **text}
    architecture = _architecture(config)
    hidden = _count(config, "hidden_size")
    heads = _count(config, "num_attention_heads")
    layers = _count(config, "num_hidden_layers")
    return ModelShape(
        architecture=architecture, num_layers=layers, hidden_size=hidden,
        num_attention_heads=heads, num_kv_heads=_count(config, "num_key_value_heads", heads),
        head_dim=_count(config, "head_dim", max(1, hidden // heads)),
        intermediate_size=_count(config, "intermediate_size", 4 * hidden),
        vocab_size=_count(config, "vocab_size", 32000),
        max_position_embeddings=_count(config, "max_position_embeddings",
                                       ENGINE_DEFAULTS.max_model_len_fallback),
        is_causal_lm=architecture.endswith(("ForCausalLM", "LMHeadModel",
                                            "ForConditionalGeneration")),
        context=context_limit(config),
        **_experts(config),
    )


def _experts(config: dict[str, Any]) -> dict[str, int]:
    """An MoE's expert fields of ModelShape (Qwen-MoE: `num_experts`, `moe_intermediate_size`,
    `shared_expert_intermediate_size`; Mixtral: `num_local_experts` of `intermediate_size`)."""
    experts = _count(config, "num_experts", 0) if config.get("num_experts") else (
        _count(config, "num_local_experts", 0) if config.get("num_local_experts") else 0)
    if not experts:
        return {}
    width = (_count(config, "moe_intermediate_size") if config.get("moe_intermediate_size")
             else _count(config, "intermediate_size"))
    shared = config.get("shared_expert_intermediate_size")
    return {"num_experts": experts, "expert_intermediate_size": width,
            "shared_expert_intermediate_size": _count(config, "shared_expert_intermediate_size")
            if shared else 0}


def estimate_num_params(shape: ModelShape, tied_embeddings: bool) -> int:
    """Parameters of a Llama-style decoder (gated MLP, GQA) of this shape. An MoE counts every
    expert in every layer (the engine holds them all, though a token reads only its top-k),
    with its router and shared expert."""
    h, hd = shape.hidden_size, shape.head_dim
    attention = h * shape.num_attention_heads * hd * 2 + h * shape.num_kv_heads * hd * 2
    mlp = 3 * h * shape.intermediate_size
    if shape.num_experts:
        mlp = (shape.num_experts * (3 * h * shape.expert_intermediate_size + h)
               + (3 * h * shape.shared_expert_intermediate_size + h
                  if shape.shared_expert_intermediate_size else 0))
    per_layer = attention + mlp + 2 * h
    embeddings = shape.vocab_size * h * (1 if tied_embeddings else 2)
    return shape.num_layers * per_layer + embeddings + h


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of one .safetensors file (reads 8 + header-length bytes)."""
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise InvalidRequest(f"{path} is too short to be a safetensors file", param="source")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise InvalidRequest(f"{path}: safetensors header of {length} bytes is implausible",
                                 param="source")
        return json_object(f.read(length), path)


def _tensors(path: Path) -> list[tuple[str, int, int]]:
    """(dtype, parameter count, bytes) of each tensor a safetensors header lists. MXFP4 weights
    (gpt-oss as OpenAI ships it: `<name>_blocks` uint8, two 4-bit values a byte, beside
    `<name>_scales`, one exponent per 32 of them) count as the parameters they pack, under dtype
    "MXFP4": the engine dequantises them at load, so the claim is the unpacked size."""
    out = []
    for name, info in read_safetensors_header(path).items():
        if name == "__metadata__":
            continue
        try:
            start, end = info["data_offsets"]
            dtype, count = str(info["dtype"]), math.prod(int(d) for d in info["shape"])
            if dtype == "U8" and name.endswith(("_blocks", "_scales")):
                dtype, count = "MXFP4", 2 * count if name.endswith("_blocks") else 0
            out.append((dtype, count, int(end) - int(start)))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"{path}: malformed safetensors header entry {name!r}: "
                                 f"{type(exc).__name__} {exc}", param="source") from None
    return out


def read_hf_profile(folder: Path) -> ModelProfile:
    config = read_config(folder / "config.json")
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
        for dtype, count, size in _tensors(file):
            num_params += count
            file_bytes += size
            dtype_bytes[dtype] = dtype_bytes.get(dtype, 0) + size
    main = max(dtype_bytes, key=lambda d: dtype_bytes[d]) if dtype_bytes else "F32"
    return ModelProfile(source=str(folder), format="safetensors", shape=shape,
                        num_params=num_params, file_bytes=file_bytes,
                        checkpoint_dtype=_TORCH_DTYPE_NAMES.get(main, main.lower()))
