"""Anthropic Messages answers as pydantic models (pure), named as the `anthropic` SDK's types, so
/openapi.json describes them and the SDK parses them: a Message, the streamed events, the
token count and errors in Anthropic's shape.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import RootModel

from shoal.services.gateway.openai.objects import OpenAIObject, Sparse

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class AnthropicUsage(OpenAIObject):
    input_tokens: int
    """Prompt tokens not read from the prefix cache (Anthropic counts cache reads apart)."""
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class TextContent(OpenAIObject):
    type: Literal["text"] = "text"
    text: str


class ThinkingContent(OpenAIObject):
    """A reasoning model's reasoning (split off by its --reasoning-parser); no signature: the
    gateway does not sign, and reads thinking blocks sent back as nothing."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseContent(OpenAIObject):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class Message(OpenAIObject):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingContent | TextContent | ToolUseContent]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: AnthropicUsage


class MessageTokensCount(OpenAIObject):
    input_tokens: int


class MessageStartEvent(OpenAIObject):
    type: Literal["message_start"] = "message_start"
    message: Message


class ContentBlockStartEvent(OpenAIObject):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ThinkingContent | TextContent | ToolUseContent


class TextDelta(OpenAIObject):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(OpenAIObject):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class InputJSONDelta(OpenAIObject):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDeltaEvent(OpenAIObject):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | ThinkingDelta | InputJSONDelta


class ContentBlockStopEvent(OpenAIObject):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class PingEvent(OpenAIObject):
    type: Literal["ping"] = "ping"


class MessageDelta(OpenAIObject):
    stop_reason: StopReason | None
    stop_sequence: str | None


class MessageDeltaUsage(Sparse):
    output_tokens: int
    input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class MessageDeltaEvent(OpenAIObject):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: MessageDeltaUsage


class MessageStopEvent(OpenAIObject):
    type: Literal["message_stop"] = "message_stop"


StreamEvent = (MessageStartEvent | ContentBlockStartEvent | PingEvent | ContentBlockDeltaEvent
               | ContentBlockStopEvent | MessageDeltaEvent | MessageStopEvent)


class MessageStreamEvent(RootModel[StreamEvent]):
    """Any streamed event (for /openapi.json: the `data:` of each `event:`)."""


class AnthropicErrorInfo(OpenAIObject):
    type: str
    message: str


class AnthropicError(OpenAIObject):
    """Every failure's body on the Messages routes (also a streamed `error` event)."""

    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
