"""Structured-output fields of the OpenAI requests (pure): OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`, each turned into the engine's StructuredOutputsOptions. One source per request:
two are refused (400) rather than one silently winning.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from shoal.services.gateway.openai.body import Body
from shoal.shared.errors import InvalidRequest
from shoal.shared.schemas.infer import StructuredOutputsOptions


class JsonSchemaFormat(Body):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredFields(Body):
    """The fields, shared by completions and chat."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsOptions | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_spec(self) -> tuple[StructuredOutputsOptions | None, str | None]:
        """(the engine's spec, the request field it came from) or (None, None)."""
        found: list[tuple[StructuredOutputsOptions, str]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append((StructuredOutputsOptions(json_object=True), "response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise InvalidRequest('response_format type "json_schema" needs json_schema',
                                     param="response_format.json_schema")
            if fmt.json_schema.schema_ is None:
                raise InvalidRequest('response_format type "json_schema" needs json_schema.schema',
                                     param="response_format.json_schema.schema")
            found.append((StructuredOutputsOptions.model_validate(
                {"json": fmt.json_schema.schema_}), "response_format.json_schema.schema"))
        if self.structured_outputs is not None:
            found.append((self.structured_outputs, "structured_outputs"))
        guided = {"guided_json": ("json", self.guided_json),
                  "guided_regex": ("regex", self.guided_regex),
                  "guided_choice": ("choice", self.guided_choice),
                  "guided_grammar": ("grammar", self.guided_grammar)}
        for param, (kind, value) in guided.items():
            if value is not None:
                found.append((StructuredOutputsOptions.model_validate({kind: value}), param))
        if len(found) > 1:
            raise InvalidRequest(f"give one way to constrain the output, got "
                                 f"{' and '.join(param for _, param in found)}",
                                 param=found[1][1])
        return found[0] if found else (None, None)


def rename_param(exc: InvalidRequest, source: str | None) -> InvalidRequest:
    """An engine 400 about structured_outputs.<kind> names the field the user actually sent."""
    param = exc.param or ""
    if (source and param.startswith("structured_outputs")
            and not source.startswith("structured_outputs")):
        exc.message = exc.message.replace(param, source)
        exc.param = source
    return exc
