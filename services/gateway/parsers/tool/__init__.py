"""vLLM's --tool-call-parser names -> the parser reading tool_choice "auto" answers (one module
each). A parser is built per choice with the offered functions' parameters schemas (qwen3_xml
types its values by them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shoal.services.gateway.parsers.common import ToolCallParser
from shoal.services.gateway.parsers.tool.hermes import HermesToolCalls
from shoal.services.gateway.parsers.tool.llama3_json import Llama3JsonToolCalls
from shoal.services.gateway.parsers.tool.mistral import MistralToolCalls
from shoal.services.gateway.parsers.tool.pythonic import PythonicToolCalls
from shoal.services.gateway.parsers.tool.qwen3_xml import Qwen3XmlToolCalls

TOOL_PARSERS: dict[str, Callable[[dict[str, Any] | None], ToolCallParser]] = {
    "hermes": HermesToolCalls,
    "llama3_json": Llama3JsonToolCalls,
    "mistral": MistralToolCalls,
    "pythonic": PythonicToolCalls,
    "qwen3_xml": Qwen3XmlToolCalls,
    "qwen3_coder": Qwen3XmlToolCalls,
}
"""Keys: shared/schemas/infer.py TOOL_CALL_PARSERS (what a deployment may name)."""


def tool_parser(name: str, tools: dict[str, Any] | None = None) -> ToolCallParser:
    """A fresh parser for one choice; `tools`: parameters schema by function name."""
    return TOOL_PARSERS[name](tools)
