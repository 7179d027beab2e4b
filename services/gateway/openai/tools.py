"""OpenAI `tools` and `tool_choice` (pure): what the engine is asked for, as vLLM does it.

"none": a plain answer (the template still sees the tools). A named function: the answer is
guided by that function's parameters schema. "required": guided by a schema for a non-empty
array of {name, parameters}, anyOf over the tools. "auto" (the default when tools are given):
free text that the model's tool-call parser reads; the engine refuses it without a parser.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from shoal.services.gateway.openai.body import Body
from shoal.shared.errors import InvalidRequest
from shoal.shared.schemas.infer import (
    FunctionCall, FunctionDefinition, StructuredOutputsOptions, ToolCall, ToolDefinition
)

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class FunctionBody(Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolBody(Body):
    type: Literal["function"]
    function: FunctionBody

    def wire(self) -> ToolDefinition:
        f = self.function
        return ToolDefinition(function=FunctionDefinition(
            name=f.name, description=f.description, parameters=f.parameters, strict=f.strict))


class FunctionCallIn(Body):
    name: str
    arguments: str


class ToolCallIn(Body):
    """A call in an assistant message the client sends back."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn

    def wire(self) -> ToolCall:
        return ToolCall(id=self.id, function=FunctionCall(name=self.function.name,
                                                          arguments=self.function.arguments))


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True, slots=True)
class ToolMode:
    """How the answer is read: "named" (function_name set), "required" or "auto"."""

    kind: Literal["named", "required", "auto"]
    function_name: str | None = None


def parameter_schemas(tools: list[ToolBody] | None) -> dict[str, Any]:
    """Each offered function's parameters schema by name (qwen3_xml types values by them)."""
    return {t.function.name: t.function.parameters or {} for t in tools or []}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools ask of the engine and of the response builder."""

    mode: ToolMode | None = None
    spec: StructuredOutputsOptions | None = None
    spec_param: str | None = None
    """The request field a bad guided schema came from (for the 400's `param`)."""


def plan_tools(tools: list[ToolBody] | None, tool_choice: ToolChoice | None,
               parallel: bool = True) -> ToolPlan:
    """`parallel` false (parallel_tool_calls): "required" asks for one call (vLLM's maxItems)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return ToolPlan()
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("tool function names must be unique", param="tools")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan()
    if choice == "auto":
        return ToolPlan(mode=ToolMode("auto"))
    if choice == "required":
        schema = required_schema(tools)
        if not parallel:
            schema["maxItems"] = 1
        return ToolPlan(ToolMode("required"),
                        StructuredOutputsOptions.model_validate({"json": schema}), "tools")
    assert isinstance(choice, NamedToolChoice)
    name = choice.function.name
    if name not in names:
        raise InvalidRequest(f"tool_choice names function {name!r}, which is not in tools "
                             f"({', '.join(names)})", param="tool_choice")
    index = names.index(name)
    parameters = tools[index].function.parameters or EMPTY_PARAMETERS
    return ToolPlan(ToolMode("named", name),
                    StructuredOutputsOptions.model_validate({"json": parameters}),
                    f"tools.{index}.function.parameters")


def required_schema(tools: list[ToolBody]) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": [{"name": <a tool>, "parameters": <its
    arguments>}, ...], the tools' $defs lifted to the top (each name with one meaning)."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        parameters = copy.deepcopy(tool.function.parameters) or dict(EMPTY_PARAMETERS)
        for name, schema in parameters.pop("$defs", {}).items():
            if name in defs and defs[name] != schema:
                raise InvalidRequest(f"tools define $defs {name!r} differently", param="tools")
            defs[name] = schema
        variants.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                        "parameters": parameters},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": variants}}
    if defs:
        schema["$defs"] = defs
    return schema
