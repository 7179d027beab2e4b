"""Anthropic Messages request bodies and their translation to an OpenAI chat request (pure).

A Messages request is answered by the chat path: `to_chat` turns it into the chat request that
means the same (system first, tool results as tool messages, tool_use blocks as tool calls,
Anthropic's tool_choice as OpenAI's), so templates, tools, limits and usage behave alike.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from shoal.services.gateway.openai.body import MAX_INT32, Body
from shoal.services.gateway.openai.protocol import ChatCompletionRequest
from shoal.shared.errors import InvalidRequest


class TextBlock(Body):
    type: Literal["text"]
    text: str


class ImageBlock(Body):
    type: Literal["image", "document"]


class ThinkingBlock(Body):
    """An earlier turn's thinking, sent back by clients; not part of the prompt (as Anthropic
    drops previous turns' thinking too)."""

    type: Literal["thinking", "redacted_thinking"]


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        content = self.content if isinstance(self.content, str) else "\n".join(
            block.text for block in self.content or [])
        return f"Error: {content}" if self.is_error else content


Block = Annotated[TextBlock | ImageBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock,
                  Field(discriminator="type")]


class MessageParam(Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolParam(Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoiceParam(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingParam(Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class Metadata(Body):
    user_id: str | None = None


class CountTokensRequest(Body):
    """POST /v1/messages/count_tokens: what the prompt of a Messages request would hold."""

    model: str = Field(min_length=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None

    def check(self) -> None:
        self.to_chat()  # a request that cannot become a chat is a 400 here too

    def chat_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"model": self.model, "messages": self._messages()}
        if self.tools:
            fields["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.input_schema}}
                for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            fields["tool_choice"] = _tool_choice(choice)
            if choice.disable_parallel_tool_use is not None:
                fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        return fields

    def to_chat(self, **extra: Any) -> ChatCompletionRequest:
        """The chat request meaning the same (a body whose fields check as chat's do)."""
        try:
            return ChatCompletionRequest.model_validate({**self.chat_fields(), **extra})
        except ValidationError as exc:
            first = exc.errors()[0]
            raise InvalidRequest(f"{'.'.join(map(str, first['loc']))}: {first['msg']}"
                                 ) from None

    def _messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.system is not None:
            system = self.system if isinstance(self.system, str) else "\n".join(
                block.text for block in self.system)
            out.append({"role": "system", "content": system})
        for i, message in enumerate(self.messages):
            blocks: list[Any] = ([TextBlock(type="text", text=message.content)]
                                 if isinstance(message.content, str) else message.content)
            for block in blocks:
                if isinstance(block, ImageBlock):
                    raise InvalidRequest(f"{block.type} blocks are not supported: the models "
                                         "served here read text", param=f"messages.{i}.content")
            if message.role == "assistant":
                out.append(_assistant(blocks))
            else:
                out.extend(_user(blocks, i))
        return out


def _assistant(blocks: list[Any]) -> dict[str, Any]:
    texts = [{"type": "text", "text": b.text} for b in blocks if isinstance(b, TextBlock)]
    calls = [{"id": b.id, "type": "function", "function": {
        "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
        for b in blocks if isinstance(b, ToolUseBlock)]
    message: dict[str, Any] = {"role": "assistant", "content": texts or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[Any], i: int) -> list[dict[str, Any]]:
    """A user turn, in its order: each tool result a tool message, the texts between them one
    user message each."""
    out: list[dict[str, Any]] = []
    texts: list[dict[str, str]] = []
    for block in blocks:
        if isinstance(block, ToolUseBlock):
            raise InvalidRequest("tool_use blocks belong to assistant turns",
                                 param=f"messages.{i}.content")
        if isinstance(block, TextBlock):
            texts.append({"type": "text", "text": block.text})
        elif isinstance(block, ToolResultBlock):
            if texts:
                out.append({"role": "user", "content": texts})
                texts = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": block.text()})
    if texts or not out:
        out.append({"role": "user", "content": texts})
    return out


def _tool_choice(choice: ToolChoiceParam) -> Any:
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequest("tool_choice of type tool needs a name", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages. max_tokens is required, as Anthropic's API requires it."""

    max_tokens: int = Field(ge=1, le=MAX_INT32)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=MAX_INT32)
    metadata: Metadata | None = None
    thinking: ThinkingParam | None = None
    """A reasoning model thinks or not: the chat template's `enable_thinking` (Qwen3's switch;
    templates without it ignore it). Its budget is not enforced."""

    def to_chat(self, **extra: Any) -> ChatCompletionRequest:
        sampling = {"max_tokens": self.max_tokens, "stream": self.stream,
                    "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                    "stop": self.stop_sequences,
                    "user": self.metadata.user_id if self.metadata else None,
                    "chat_template_kwargs": (
                        {"enable_thinking": self.thinking.type != "disabled"}
                        if self.thinking is not None else None)}
        body = super().to_chat(**{k: v for k, v in sampling.items() if v is not None}, **extra)
        try:
            body.check()
        except InvalidRequest as exc:  # named as this API names the field
            exc.param = CHAT_PARAMS.get(exc.param or "", exc.param)
            raise
        return body


CHAT_PARAMS = {"stop": "stop_sequences", "tools": "tools", "tool_choice": "tool_choice"}
"""Chat's name of a field -> the Messages API's (for a 400's `param`)."""
