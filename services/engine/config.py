"""EngineConfig: every knob of one engine instance, frozen, built once at the process edge, and
ENGINE_DEFAULTS, the values of the knobs left unset, which the scheduler's claims read too.
Torch-free, so the scheduler imports it without loading the model code.

Nothing below the entry point reads the environment: the CLI, `LLM(...)` or the engine process
builds this object and passes it down (docs/architecture.md "Config objects"). The one setting
the environment gives, OMP_NUM_THREADS for an unset `num_threads`, is read here, when the object
is built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from shoal.shared.errors import InvalidRequest
from shoal.shared.schemas.engine_args import (LOAD_FORMATS, QUANTIZATIONS, TASKS,
                                              check_pooler_config)
from shoal.shared.schemas.infer import REASONING_PARSERS, TOOL_CALL_PARSERS
from shoal.shared.schemas.speculative import SpeculativeConfig, parse_speculative_config
from shoal.shared.units import GIB, MIB

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class ConfigError(InvalidRequest):
    """An engine setting that cannot work (refused before any memory is allocated)."""

    code = "invalid_engine_config"


@dataclass(frozen=True, slots=True)
class EngineDefaults:
    """What an engine uses for a setting left unset: one place, so the scheduler's claim of an
    instance and the engine that runs it agree."""

    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_memory: int = 1 * GIB
    """The KV pool on CPU when kv_cache_memory is not set (on CUDA it is profiled)."""
    gpu_activation_reserve: int = 512 * MIB
    """Left free on a GPU beside the KV pool when the pool is sized by gpu_memory_utilization."""
    max_model_len_fallback: int = 2048
    """max_model_len when the model's config has no max_position_embeddings."""

    @staticmethod
    def dtype(dtype: str, device_type: str) -> str:
        """The dtype an engine runs in: 'auto' is float32 on the CPU and bfloat16 on a GPU."""
        if dtype == "auto":
            return "float32" if device_type == "cpu" else "bfloat16"
        if dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype must be auto, float32, float16 or bfloat16, got {dtype!r}",
                              param="dtype")
        return dtype


ENGINE_DEFAULTS = EngineDefaults()


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
    block_size: int = ENGINE_DEFAULTS.block_size
    max_num_seqs: int = ENGINE_DEFAULTS.max_num_seqs
    max_num_batched_tokens: int = ENGINE_DEFAULTS.max_num_batched_tokens
    max_model_len: int | None = None
    """Context limit; defaults to the model's max_position_embeddings."""
    kv_cache_memory: int | None = None
    """Bytes for the KV pool. None: 1 GiB on CPU, profiled from gpu_memory_utilization on CUDA."""
    num_kv_blocks: int | None = None
    """Force the pool size in blocks (tests use it to provoke preemption)."""
    gpu_memory_utilization: float = ENGINE_DEFAULTS.gpu_memory_utilization
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    cache_dir: str | None = None
    """Where converted models (GGUF -> safetensors) are cached; default ~/.cache/shoal/models."""
    num_threads: int | None = None
    """torch intra-op threads. Unset: OMP_NUM_THREADS when the building process has it set to a
    positive count (read when this object is built), else None: on CPU every usable core
    (vLLM-CPU's rule; services/engine/runner/cpu_threads.py)."""
    enforce_eager: bool = False
    """Disable CUDA graphs (CUDA path only)."""
    cpu_gemv: bool | None = None
    """CPU, float32: steps of up to 32 tokens run a C++ matmul over each Linear's weight packed
    into panels (cpu_ops.panel_matmul), kept beside oneDNN's packed copy (one more copy of the
    weights; the name is from the GEMV it replaced). None: on when that copy takes under an
    eighth of the machine's memory; False saves the memory (layers/cpu_weights.py)."""
    quantization: str | None = None
    """vLLM's arg (CPU path): "int8" = int8 weights, one scale per output row; "int4" = 4-bit
    weights in groups of 32 (both quantised at load); "gguf" = a .gguf model's own blocks (Q8_0,
    K-quants, Q4_1...; no dequantise + requantise); "none" = the checkpoint's dtype (a .gguf
    dequantised to fp32); None = "gguf" for a .gguf model on one rank, else "none"
    (layers/cpu_weights.py resolve_quantization)."""
    load_format: str = "auto"
    """vLLM's --load-format: "auto" / "safetensors" read the folder's weights; "dummy" fills every
    weight with seeded random values instead (uniform in +-1e-3, vLLM's), so a folder of
    config.json + tokenizer runs: benchmarks at sizes nobody downloads (runner/loader.py)."""
    tool_call_parser: str | None = None
    """How "auto" tool-choice answers are parsed for tool calls (vLLM's --tool-call-parser):
    one of TOOL_CALL_PARSERS (hermes, llama3_json, mistral, pythonic, qwen3_xml); None refuses
    tool_choice "auto"."""
    reasoning_parser: str | None = None
    """How chat answers' <think> reasoning is split from their content (vLLM's
    --reasoning-parser): one of REASONING_PARSERS (deepseek_r1, qwen3); the gateway applies it."""
    chat_template: str | None = None
    """A Jinja chat template used instead of the tokenizer's (vLLM's --chat-template)."""
    speculative_config: SpeculativeConfig | dict | str | None = None
    """vLLM's speculative_config (a dict or JSON text; stored parsed): n-gram, draft-model or
    layer-skip proposers verified in one target forward (docs/engine-core.md)."""
    tensor_parallel_size: int = 1
    """Ranks that split every layer (heads, MLP, vocabulary); vLLM's --tensor-parallel-size."""
    pipeline_parallel_size: int = 1
    """Stages of contiguous layers, one tensor-parallel group each; vLLM's
    --pipeline-parallel-size. tp * pp ranks in all (distributed/executor.py)."""
    enable_lora: bool = False
    """Serve LoRA adapters over the base model (vLLM's --enable-lora): requests name one with a
    LoRARequest; a step mixes adapters and the base model (runner/lora_manager.py)."""
    max_loras: int = 1
    """Distinct adapters one step may run (vLLM's --max-loras): the scheduler holds back a
    request whose adapter would exceed it; the runner keeps this many on the device."""
    max_lora_rank: int = 16
    """The largest adapter rank accepted (vLLM's --max-lora-rank); higher ranks are refused."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded in host memory, least recently used evicted (vLLM's
    --max-cpu-loras); None = max_loras."""
    task: str = "auto"
    """vLLM's --task: "embed" serves a causal LM (Qwen3-Embedding) on the embedding engine,
    pooled by its last token; "auto" does so when the folder has sentence-transformers' pooling
    files; "generate" never (embedding/pooling.py)."""
    override_pooler_config: dict | str | None = None
    """vLLM's --override-pooler-config ({"pooling_type": "LAST" | "MEAN" | "CLS", "normalize":
    bool}; JSON text is parsed): overrides the folder's pooling files."""
    distributed_init_method: str | None = None
    """torch.distributed rendezvous (tcp://host:port, rank 0's TCPStore) when the ranks are
    started by someone else (the worker agent); None: the executor spawns the ranks itself on a
    free local port."""

    def __post_init__(self) -> None:
        try:
            spec = parse_speculative_config(self.speculative_config)
        except InvalidRequest as exc:
            raise ConfigError(exc.message, param="speculative_config") from None
        object.__setattr__(self, "speculative_config", spec)
        if self.num_threads is None:
            object.__setattr__(self, "num_threads", omp_num_threads())
        def refuse(field: str, rule: str) -> None:
            raise ConfigError(f"{field} must be {rule}, got {getattr(self, field)!r}", param=field)

        if self.task not in TASKS:
            refuse("task", f"one of {', '.join(TASKS)}")
        try:
            object.__setattr__(self, "override_pooler_config",
                               check_pooler_config(self.override_pooler_config))
        except ValueError as exc:
            raise ConfigError(str(exc), param="override_pooler_config") from None
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            refuse("block_size", "a positive power of two")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks",
                     "num_threads", "tensor_parallel_size", "pipeline_parallel_size",
                     "max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and value < 1:
                refuse(name, ">= 1")
        if self.speculative_config is not None and (
                self.tensor_parallel_size * self.pipeline_parallel_size > 1):
            raise ConfigError("speculative decoding runs on one rank: it cannot be combined with "
                              "tensor_parallel_size / pipeline_parallel_size > 1 yet",
                              param="speculative_config")
        if self.enable_lora and self.speculative_config is not None:
            raise ConfigError("speculative decoding is not supported with LoRA adapters "
                              "(enable_lora): drafts would run without the requests' adapters",
                              param="speculative_config")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                              f"({self.max_loras})", param="max_cpu_loras")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            refuse("kv_cache_memory", "> 0 bytes")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            refuse("gpu_memory_utilization", "in (0, 1]")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            refuse("tool_call_parser", f"one of {', '.join(TOOL_CALL_PARSERS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            refuse("reasoning_parser", f"one of {', '.join(REASONING_PARSERS)}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            refuse("quantization", f"one of {', '.join(QUANTIZATIONS)} or None")
        if self.load_format not in LOAD_FORMATS:
            refuse("load_format", f"one of {', '.join(LOAD_FORMATS)}")
        if self.load_format == "dummy" and str(self.model).endswith(".gguf"):
            raise ConfigError('load_format "dummy" makes random weights for a model folder\'s '
                              "config.json: a .gguf file brings its own weights",
                              param="load_format")
        if self.quantization == "gguf" and not str(self.model).endswith(".gguf"):
            raise ConfigError('quantization "gguf" runs a .gguf file\'s own blocks: the model '
                              f"must be a .gguf file, got {self.model!r}", param="quantization")
        if self.quantization == "gguf" and (
                self.tensor_parallel_size * self.pipeline_parallel_size > 1):
            raise ConfigError('quantization "gguf" runs on one rank (tensor_parallel_size and '
                              "pipeline_parallel_size 1)", param="quantization")
        ENGINE_DEFAULTS.dtype(self.dtype, "cpu")  # ConfigError for an unknown dtype
        if not self.enable_chunked_prefill and self.max_model_len is not None:
            if self.max_num_batched_tokens < self.max_model_len:
                raise ConfigError(
                    "without chunked prefill max_num_batched_tokens must be >= max_model_len "
                    f"({self.max_num_batched_tokens} < {self.max_model_len})",
                    param="max_num_batched_tokens")


def omp_num_threads() -> int | None:
    """OMP_NUM_THREADS when set to a positive integer (the user's thread count for every
    OpenMP program), else None."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(env) if env.isdigit() and int(env) > 0 else None
