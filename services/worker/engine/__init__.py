"""The inference engine: LLM (offline), AsyncEngine (serving), EngineConfig, SamplingParams.

Exports resolve lazily (module __getattr__), so importing a light submodule such as
sampling_params never pulls in torch or the model code.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "LLM": "llm",
    "SamplingParams": "sampling_params",
    "StructuredOutputsParams": "sampling_params",
    "AsyncEngine": "async_engine",
    "EngineConfig": "config",
    "RequestOutput": "request_output",
    "CompletionOutput": "request_output",
    "EngineCore": "engine_core",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{module}"), name)
