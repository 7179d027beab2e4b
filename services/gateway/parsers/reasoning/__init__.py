"""vLLM's --reasoning-parser names -> the parser splitting a chat answer's reasoning from its
content (one module each)."""

from __future__ import annotations

from collections.abc import Callable

from shoal.services.gateway.parsers.reasoning.deepseek_r1 import DeepSeekR1Reasoning
from shoal.services.gateway.parsers.reasoning.qwen3 import Qwen3Reasoning
from shoal.services.gateway.parsers.reasoning.think import ReasonedDelta, ThinkParser

REASONING_PARSERS: dict[str, Callable[[], ThinkParser]] = {
    "deepseek_r1": DeepSeekR1Reasoning,
    "qwen3": Qwen3Reasoning,
}
"""Keys: shared/schemas/infer.py REASONING_PARSERS (what a deployment may name)."""

__all__ = ["REASONING_PARSERS", "ReasonedDelta", "ThinkParser", "reasoning_parser"]


def reasoning_parser(name: str) -> ThinkParser:
    return REASONING_PARSERS[name]()
