"""EngineConfig: every knob of one engine instance, frozen, built once at the process edge.

Nothing below the entry point reads the environment: the CLI, `LLM(...)` or the engine process
builds this object and passes it down (STYLE.md "Config objects").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.shared.errors import InvalidRequest
from shoal.shared.schemas.infer import TOOL_CALL_PARSERS


class ConfigError(InvalidRequest):
    """An engine setting that cannot work (refused before any memory is allocated)."""

    code = "invalid_engine_config"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str
    """A Hugging Face folder (config.json + *.safetensors + tokenizer) or a .gguf file."""
    tokenizer: str | None = None
    """Tokenizer folder; defaults to the (prepared) model folder."""
    dtype: str = "auto"
    """'auto' = float32 on CPU, bfloat16 on CUDA; or float32 / float16 / bfloat16."""
    device: str = "auto"
    """'auto' = cuda when torch sees one, else cpu."""
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    """Context limit; defaults to the model's max_position_embeddings."""
    kv_cache_memory: int | None = None
    """Bytes for the KV pool. None: 1 GiB on CPU, profiled from gpu_memory_utilization on CUDA."""
    num_kv_blocks: int | None = None
    """Force the pool size in blocks (tests use it to provoke preemption)."""
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    cache_dir: str | None = None
    """Where converted models (GGUF -> safetensors) are cached; default ~/.cache/shoal/models."""
    num_threads: int | None = None
    """torch intra-op threads on CPU; None leaves torch's default."""
    enforce_eager: bool = False
    """Disable CUDA graphs (CUDA path only)."""
    tool_call_parser: str | None = None
    """How "auto" tool-choice answers are parsed for tool calls (vLLM's --tool-call-parser):
    "hermes" (<tool_call>{...}</tool_call>); None refuses tool_choice "auto"."""
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                              f"got {self.tool_call_parser!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ConfigError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if not self.enable_chunked_prefill and self.max_model_len is not None:
            if self.max_num_batched_tokens < self.max_model_len:
                raise ConfigError(
                    "without chunked prefill max_num_batched_tokens must be >= max_model_len "
                    f"({self.max_num_batched_tokens} < {self.max_model_len})"
                )
