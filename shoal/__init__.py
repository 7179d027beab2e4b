"""Shoal: an LLM serving system. `from shoal import LLM, SamplingParams` as with vLLM
(and StructuredOutputsParams, for guided decoding).

The engine loads lazily (module __getattr__) so `import shoal` stays light for the CLI.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from shoal.services.worker.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from shoal.services.worker.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from shoal.services.worker.engine.sampling_params import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(f"module 'shoal' has no attribute {name!r}")
