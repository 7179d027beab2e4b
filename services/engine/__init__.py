"""The inference engine, a package of its own: the offline `LLM`, the `AsyncEngine` that serves,
`EngineConfig`, `SamplingParams`, model preparation, and `run_engine` (the engine process on the
bus, in server/). These names are its public API: other services and the CLI import nothing else
from it (tests/unit/test_layering.py checks).

Exports resolve lazily (module __getattr__), so importing a light name such as SamplingParams or
the engine defaults never pulls in torch, the model code or nats.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "LLM": "frontend.llm",
    "SamplingParams": "sampling_params",
    "LoRARequest": "lora_request",
    "StructuredOutputsParams": "sampling_params",
    "AsyncEngine": "frontend.async_engine",
    "EngineConfig": "config",
    "ConfigError": "config",
    "ENGINE_DEFAULTS": "config",
    "DTYPE_BYTES": "config",
    "ContextLimit": "model_limits",
    "context_limit": "model_limits",
    "resolve_max_model_len": "model_limits",
    "check_parallel_sizes": "model_limits",
    "tp_problems": "model_limits",
    "valid_tp_sizes": "model_limits",
    "mlp_split_size": "model_limits",
    "MLP_SIZE_KEYS": "model_limits",
    "RequestOutput": "core.request_output",
    "CompletionOutput": "core.request_output",
    "RequestOutputKind": "core.request_output",
    "EngineCore": "core.engine_core",
    "prepare_model": "model_prep",
    "smollm2_gguf_path": "model_prep",
    "minilm_path": "model_prep",
    "EmbeddingEngine": "embedding.engine",
    "is_embedding_model": "embedding.pooling",
    "is_cross_encoder": "embedding.pooling",
    "tqdm_progress": "model_prep",
    "run_engine": "server.service",
    "RankLaunch": "distributed.launch",
    "core_shares": "distributed.launch",
    "load_tokenizer": "frontend.tokenizer",
    "InputProcessor": "input_processor",
    "StreamIntake": "server.intake",
    "Replies": "server.intake",
    "serve_instance": "server.lifecycle",
    "InstanceReporter": "server.lifecycle",
    "Gone": "server.lifecycle",
    "report_error": "server.lifecycle",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{module}"), name)
