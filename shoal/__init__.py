"""Shoal: an LLM serving system. `from shoal import LLM, SamplingParams` as with vLLM
(and StructuredOutputsParams, for guided decoding; LoRARequest, for LoRA adapters).

The engine loads lazily (module __getattr__) so `import shoal` stays light for the CLI.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "LoRARequest"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from shoal.services import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'shoal' has no attribute {name!r}")
