"""OpenAI Responses request bodies and their translation to a chat request (pure).

A turn's chat messages are: `instructions` as the system message (never carried to the next
turn, as OpenAI does not carry them), the stored conversation of `previous_response_id`, then
this request's `input` (a string: one user message; items: messages, function calls and their
outputs, in order).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError

from shoal.services.gateway.openai.body import MAX_INT32, Body
from shoal.services.gateway.openai.protocol import ChatCompletionRequest
from shoal.shared.errors import InvalidRequest


class InputContentPart(Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessageItem(Body):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputContentPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str


class ReasoningItem(Body):
    """An earlier answer's reasoning sent back: not part of the prompt."""

    type: Literal["reasoning"]


Item = FunctionCallItem | FunctionCallOutputItem | ReasoningItem | InputMessageItem


class FunctionTool(Body):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(Body):
    type: Literal["function"]
    name: str


class ResponseTextFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseTextConfig(Body):
    format: ResponseTextFormat | None = None


class ResponsesRequest(Body):
    """POST /v1/responses."""

    model: str = Field(min_length=1)
    input: str | list[Item]
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=100)
    store: bool = True
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: ResponseTextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    def check(self) -> None:
        self.to_chat([])

    def turn_messages(self) -> list[dict[str, Any]]:
        """This request's input as chat messages (consecutive function calls: one assistant
        message with several tool calls, as chat holds them)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for item in self.input:
            if isinstance(item, InputMessageItem):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id,
                            "content": item.output})
        if not out:
            raise InvalidRequest("input holds no message", param="input")
        return out

    def to_chat(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request of this turn after `history` (a stored conversation)."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        fields: dict[str, Any] = {"model": self.model, "stream": self.stream,
                                  "messages": [*system, *history, *self.turn_messages()]}
        optional = {"max_tokens": self.max_output_tokens, "temperature": self.temperature,
                    "top_p": self.top_p, "user": self.user,
                    "parallel_tool_calls": self.parallel_tool_calls,
                    "response_format": self._response_format()}
        fields.update({k: v for k, v in optional.items() if v is not None})
        if self.tools:
            fields["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.parameters,
                "strict": t.strict}} for t in self.tools]
        if self.tool_choice is not None:
            fields["tool_choice"] = (self.tool_choice if isinstance(self.tool_choice, str) else
                                     {"type": "function",
                                      "function": {"name": self.tool_choice.name}})
        try:
            chat = ChatCompletionRequest.model_validate(fields)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise InvalidRequest(f"{'.'.join(map(str, first['loc']))}: {first['msg']}"
                                 ) from None
        try:
            chat.check()
        except InvalidRequest as exc:  # named as this API names the field
            exc.param = {"max_tokens": "max_output_tokens",
                         "response_format": "text.format"}.get(exc.param or "", exc.param)
            raise
        return chat

    def _response_format(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        if fmt.schema_ is None:
            raise InvalidRequest("text.format json_schema needs a schema",
                                 param="text.format.schema")
        return {"type": "json_schema", "json_schema": {
            "name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}}
