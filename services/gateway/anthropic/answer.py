"""A chat answer in Anthropic's Messages shape (pure): the whole Message, or its streamed events
in Anthropic's order (message_start, then per content block content_block_start [ping after
the first], content_block_delta..., content_block_stop, then message_delta with the stop reason
and usage, and message_stop), and errors in Anthropic's shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from shoal.services.gateway.anthropic.objects import (
    AnthropicError, AnthropicErrorInfo, AnthropicUsage, ContentBlockDeltaEvent,
    ContentBlockStartEvent, ContentBlockStopEvent, InputJSONDelta, Message, MessageDelta,
    MessageDeltaEvent, MessageDeltaUsage, MessageStartEvent, MessageStopEvent, PingEvent,
    StopReason, StreamEvent, TextContent, TextDelta, ThinkingContent, ThinkingDelta,
    ToolUseContent
)
from shoal.services.gateway.openai.objects import ChatChunkChoice, ChatCompletion
from shoal.shared.schemas.infer import Usage

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               409: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}
"""HTTP status -> Anthropic's error type (anything else 5xx: api_error)."""


def error_body(status: int, message: str) -> AnthropicError:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return AnthropicError(error=AnthropicErrorInfo(type=kind, message=message))


def sse(event: StreamEvent | AnthropicError) -> bytes:
    """One event, named as Anthropic names them (the SDK dispatches on `event:`)."""
    return b"event: " + event.type.encode() + b"\ndata: " + event.body_json() + b"\n\n"


def stop_reason(finish: str | None, stop: int | str | None) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence) from chat's finish reason and vLLM's stop_reason (the stop
    string that matched, or a stop token's id)."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def usage(usage: Usage | None) -> AnthropicUsage:
    usage = usage or Usage(prompt_tokens=0, completion_tokens=0)
    return AnthropicUsage(input_tokens=usage.prompt_tokens - usage.cached_tokens,
                          output_tokens=usage.completion_tokens,
                          cache_read_input_tokens=usage.cached_tokens)


def message_id(chat_id: str) -> str:
    """The Message id of the chat answer with this id (one id in logs and traces)."""
    return "msg_" + chat_id.partition("-")[2]


def tool_input(arguments: str) -> dict[str, object]:
    """A call's arguments as an object; a call cut short (max_tokens) has none whole: {}."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message(completion: ChatCompletion, stop: int | str | None, used: Usage | None) -> Message:
    """The non-streamed answer: text, then tool_use blocks."""
    choice = completion.choices[0]
    content: list[ThinkingContent | TextContent | ToolUseContent] = []
    if choice.message.reasoning_content:
        content.append(ThinkingContent(thinking=choice.message.reasoning_content))
    if choice.message.content:
        content.append(TextContent(text=choice.message.content))
    for call in choice.message.tool_calls or []:
        content.append(ToolUseContent(id=call.id, name=call.function.name,
                                      input=tool_input(call.function.arguments)))
    reason, sequence = stop_reason(choice.finish_reason, stop)
    return Message(id=message_id(completion.id), model=completion.model, content=content,
                   stop_reason=reason, stop_sequence=sequence, usage=usage(used))


@dataclass(slots=True)
class MessageStream:
    """Chat chunk entries in, Anthropic events out (bytes to write)."""

    id: str
    model: str
    index: int = -1
    """The open content block's index (-1: none opened yet)."""
    open_kind: str | None = None
    pinged: bool = False
    blocks: dict[int, int] = field(default_factory=dict)
    """A tool call's index among the choice's calls -> its content block's index."""

    def start(self, prompt_tokens: int) -> bytes:
        """message_start: the prompt's size is known once the engine accepted it."""
        return sse(MessageStartEvent(message=Message(
            id=self.id, model=self.model, content=[], stop_reason=None, stop_sequence=None,
            usage=AnthropicUsage(input_tokens=prompt_tokens, output_tokens=0))))

    def _open(self, kind: str, block: ThinkingContent | TextContent | ToolUseContent) -> bytes:
        out = self._close()
        self.index += 1
        self.open_kind = kind
        out += sse(ContentBlockStartEvent(index=self.index, content_block=block))
        if not self.pinged:
            self.pinged = True
            out += sse(PingEvent())
        return out

    def _close(self) -> bytes:
        if self.open_kind is None:
            return b""
        self.open_kind = None
        return sse(ContentBlockStopEvent(index=self.index))

    def feed(self, entries: list[ChatChunkChoice]) -> bytes:
        out = b""
        for entry in entries:
            delta = entry.delta
            if delta.reasoning_content:
                if self.open_kind != "thinking":
                    out += self._open("thinking", ThinkingContent(thinking=""))
                out += sse(ContentBlockDeltaEvent(
                    index=self.index, delta=ThinkingDelta(thinking=delta.reasoning_content)))
            if delta.content:
                if self.open_kind != "text":
                    out += self._open("text", TextContent(text=""))
                out += sse(ContentBlockDeltaEvent(index=self.index,
                                                  delta=TextDelta(text=delta.content)))
            for call in delta.tool_calls or []:
                function = call.function
                if call.id is not None:
                    out += self._open("tool_use", ToolUseContent(
                        id=call.id, name=function.name if function else "", input={}))
                    self.blocks[call.index] = self.index
                if function is not None and function.arguments:
                    out += sse(ContentBlockDeltaEvent(
                        index=self.blocks.get(call.index, self.index),
                        delta=InputJSONDelta(partial_json=function.arguments)))
        return out

    def finish(self, finish: str | None, stop: int | str | None, used: Usage | None) -> bytes:
        """The last block's stop, message_delta (stop reason, usage) and message_stop."""
        reason, sequence = stop_reason(finish, stop)
        total = usage(used)
        return (self._close()
                + sse(MessageDeltaEvent(
                    delta=MessageDelta(stop_reason=reason, stop_sequence=sequence),
                    usage=MessageDeltaUsage(output_tokens=total.output_tokens,
                                            input_tokens=total.input_tokens,
                                            cache_read_input_tokens=(
                                                total.cache_read_input_tokens))))
                + sse(MessageStopEvent()))
