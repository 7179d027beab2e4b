"""vLLM's `qwen3_xml` (and `qwen3_coder`) parser, Qwen3-Coder's format:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Values are text; each is typed by the offered function's parameters schema (integer, number,
boolean, null, objects and arrays as JSON or Python literals; strings stay as written), as vLLM
does. A parameter left unclosed ends at the next one or at </function>."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from shoal.services.gateway.parsers.tool.tagged import TaggedCalls

FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)",
                       re.DOTALL)


class Qwen3XmlToolCalls(TaggedCalls):
    def parse_body(self, body: str) -> list[tuple[str, Any]] | None:
        calls = []
        for match in FUNCTION.finditer(body):
            name = match.group(1).strip()
            properties = (self.tools.get(name) or {}).get("properties") or {}
            arguments = {}
            for param in PARAMETER.finditer(match.group(2)):
                key = param.group(1).strip()
                arguments[key] = typed(_trim(param.group(2)), properties.get(key))
            calls.append((name, arguments))
        return calls or None


def _trim(value: str) -> str:
    """The value without the one newline after its tag and before its closing tag."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def typed(value: str, schema: Any) -> Any:
    """A parameter's text as its schema's type (text when it does not read as one)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["integer", "null"]: the first that is not null
        kind = next((k for k in kind if k != "null"), "string")
    if value.strip().lower() == "null":  # any type (vLLM's rule)
        return None
    if kind in ("string", "str", "text"):
        return value
    text = value.strip()
    try:
        if kind in ("integer", "int"):
            return int(text)
        if kind in ("number", "float"):
            number = float(text)
            return int(number) if number.is_integer() and "." not in text else number
        if kind in ("boolean", "bool"):
            if text.lower() in ("true", "false"):
                return text.lower() == "true"
            return value
    except ValueError:
        return value
    if kind is None and schema is None:
        return value  # a parameter the function does not declare: as written (vLLM's rule)
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        literal = ast.literal_eval(text)
        json.dumps(literal)  # a set or bytes is no JSON value
        return literal
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return value
