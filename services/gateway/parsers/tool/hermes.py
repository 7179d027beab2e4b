"""vLLM's `hermes` parser: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes 2/3,
Qwen2.5, Qwen3 and most tool-tuned models); text outside the tags is content."""

from __future__ import annotations

import json
from typing import Any

from shoal.services.gateway.parsers.common import call_fields
from shoal.services.gateway.parsers.tool.tagged import TaggedCalls


class HermesToolCalls(TaggedCalls):
    def parse_body(self, body: str) -> list[tuple[str, Any]] | None:
        try:
            call = call_fields(json.loads(body), "arguments")
        except ValueError:
            return None
        return [call] if call is not None else None
