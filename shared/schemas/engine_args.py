"""EngineArgs: a model's engine settings on the wire (ModelSpec.engine_args), mirroring the
engine's EngineConfig as SamplingOptions mirrors SamplingParams. Every field is optional: None
is the engine's own default (services/engine/config.py ENGINE_DEFAULTS), so no default is
restated here. The rules are checked when a model is deployed (a 400 naming the field) instead
of when its engine starts; tests/unit/test_wire_engine_args.py keeps the two from drifting.

The model's source, tokenizer, device and cache folder are the worker's to decide; max_model_len,
dtype and gpu_memory_utilization are top-level ModelSpec fields (GPUStack's shape).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from shoal.shared.schemas.common import Wire
from shoal.shared.schemas.infer import REASONING_PARSERS, TOOL_CALL_PARSERS
from shoal.shared.schemas.speculative import SpeculativeConfig

QUANTIZATIONS = ("int8", "int4", "gguf", "none")
"""`quantization` values the engine implements (CPU path): "int8" and "int4" quantise the
checkpoint's weights at load, "gguf" runs a .gguf file's own blocks (Q8_0, Q4_K, Q5_K, Q6_K,
Q4_1...; vLLM's name for GGUF checkpoints, and a .gguf model's default on one rank), "none" runs
the checkpoint's dtype (a .gguf dequantised: the fp32 reference); README's table says which is
faster when."""

LOAD_FORMATS = ("auto", "safetensors", "dummy")
"""vLLM's --load-format values the engine implements: "auto" and "safetensors" read the folder's
*.safetensors; "dummy" gives every weight random values (uniform in +-1e-3, seeded, as vLLM's
DummyModelLoader), so config.json and the tokenizer are all a folder needs (benchmarks at sizes
whose weights nobody downloads)."""

TASKS = ("auto", "generate", "embed")
"""vLLM's --task: "embed" serves a causal LM (Qwen3-Embedding) for /v1/embeddings; "auto" does
so when its folder has sentence-transformers' pooling files (modules.json)."""
POOLING_TYPES = ("LAST", "MEAN", "CLS")
"""vLLM's pooler_config pooling_type values the embedding engine implements."""


def check_pooler_config(value: Any) -> dict[str, Any] | None:
    """vLLM's --override-pooler-config (a JSON object or its text): `pooling_type` and
    `normalize`; ValueError naming what is wrong."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError("override_pooler_config must be a JSON object") from None
    if not isinstance(value, dict):
        raise ValueError("override_pooler_config must be a JSON object")
    unknown = set(value) - {"pooling_type", "normalize"}
    if unknown:
        raise ValueError(f"override_pooler_config: {sorted(unknown)} not supported "
                         "(pooling_type and normalize are)")
    kind = value.get("pooling_type")
    if kind is not None and str(kind).upper() not in POOLING_TYPES:
        raise ValueError(f"override_pooler_config.pooling_type must be one of "
                         f"{', '.join(POOLING_TYPES)}, got {kind!r}")
    normalize = value.get("normalize")
    if isinstance(normalize, str) and normalize.lower() in ("true", "false"):
        normalize = normalize.lower() == "true"  # the dashboard's key=value form sends text
    if normalize is not None and not isinstance(normalize, bool):
        raise ValueError("override_pooler_config.normalize must be true or false")
    return {**value, **({"pooling_type": str(kind).upper()} if kind is not None else {}),
            **({"normalize": normalize} if normalize is not None else {})}


class EngineArgs(Wire):
    block_size: int | None = Field(default=None, gt=0)
    """KV block size in tokens: a power of two."""
    max_num_seqs: int | None = Field(default=None, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    kv_cache_memory: int | None = Field(default=None, gt=0)
    """Bytes of the KV pool (default: 1 GiB on CPU, profiled on CUDA)."""
    num_kv_blocks: int | None = Field(default=None, ge=1)
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    seed: int | None = None
    num_threads: int | None = Field(default=None, ge=1)
    """torch intra-op threads on CPU (default: all usable cores but one)."""
    enforce_eager: bool | None = None
    cpu_gemv: bool | None = None
    """CPU, float32: keep plain weights for the single-stream GEMV (default: when they take
    under an eighth of the machine's memory)."""
    quantization: str | None = None
    """vLLM's --quantization: "int8", "int4", "gguf" or "none" (CPU path; unset: a .gguf source
    runs its own blocks, any other its dtype)."""
    load_format: str | None = None
    """vLLM's --load-format: "auto", "safetensors" or "dummy" (random weights of the config)."""
    tool_call_parser: str | None = None
    """vLLM's --tool-call-parser: shared/schemas/infer.py TOOL_CALL_PARSERS."""
    reasoning_parser: str | None = None
    """vLLM's --reasoning-parser: shared/schemas/infer.py REASONING_PARSERS."""
    chat_template: str | None = Field(default=None, min_length=1)
    """A Jinja chat template replacing the tokenizer's (vLLM's --chat-template)."""
    speculative_config: SpeculativeConfig | None = None
    """vLLM's --speculative-config, e.g. {"method": "ngram", "num_speculative_tokens": 4}."""
    enable_lora: bool | None = None
    """vLLM's --enable-lora: requests may name LoRA adapters of this model (its lora_modules)."""
    max_loras: int | None = Field(default=None, ge=1)
    """Distinct adapters in one step (vLLM's --max-loras; default 1)."""
    max_lora_rank: int | None = Field(default=None, ge=1)
    """Largest adapter rank accepted (vLLM's --max-lora-rank; default 16)."""
    max_cpu_loras: int | None = Field(default=None, ge=1)
    """Adapters kept in host memory (vLLM's --max-cpu-loras; default max_loras)."""
    task: Literal["auto", "generate", "embed"] | None = None
    """vLLM's --task: auto, generate or embed (a causal LM as a last-token embedder)."""
    override_pooler_config: dict[str, Any] | None = None
    """vLLM's --override-pooler-config, e.g. {"pooling_type": "LAST", "normalize": true}."""

    @field_validator("override_pooler_config", mode="before")
    @classmethod
    def _pooler_config(cls, value: Any) -> dict[str, Any] | None:
        return check_pooler_config(value)

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int | None) -> int | None:
        if value is not None and value & (value - 1):
            raise ValueError(f"block_size must be a power of two, got {value}")
        return value

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _json_text(cls, value: Any) -> Any:
        """`--engine-arg speculative_config='{...}'` arrives as JSON text."""
        if isinstance(value, str):
            try:
                return json.loads(value)
            except ValueError:
                raise ValueError("speculative_config must be a JSON object") from None
        return value

    @field_validator("quantization")
    @classmethod
    def _known_quantization(cls, value: str | None) -> str | None:
        if value is not None and value not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, "
                             f"got {value!r}")
        return value

    @field_validator("load_format")
    @classmethod
    def _known_load_format(cls, value: str | None) -> str | None:
        if value is not None and value not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, "
                             f"got {value!r}")
        return value

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parser(cls, value: str | None) -> str | None:
        if value is not None and value not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {value!r}")
        return value

    @model_validator(mode="after")
    def _lora_rules(self) -> EngineArgs:
        """EngineConfig's LoRA rules, refused at deploy time."""
        if self.enable_lora and self.speculative_config is not None:
            raise ValueError("speculative decoding is not supported with LoRA adapters "
                             "(enable_lora)")
        if self.max_cpu_loras is not None and self.max_cpu_loras < (self.max_loras or 1):
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras or 1})")
        return self

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, value: str | None) -> str | None:
        if value is not None and value not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {value!r}")
        return value

    def given(self) -> dict[str, Any]:
        """The settings given (not None), as EngineConfig keyword arguments."""
        return {k: v for k, v in self.model_dump(exclude_none=True).items()}
