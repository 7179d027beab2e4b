"""The two OpenAI answers built from the engine's stream (pure): chat (`chat.completion`, or
`chat.completion.chunk` events with the role on a choice's first, tool calls as
`message.tool_calls` or streamed tool_call deltas) and completions (`text_completion`, whole or
streamed, with `echo`). The shared bookkeeping is responses.py's `ResponseBuilder`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from shoal.services.gateway.openai.objects import (
    ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatMessage, Completion,
    CompletionChoice, CompletionChunk, DeltaFunctionCall, DeltaMessage, DeltaToolCall
)
from shoal.services.gateway.openai.responses import (
    ChoiceState, ResponseBuilder, chat_logprobs, completion_logprobs, usage_info
)
from shoal.services.gateway.openai.tool_parsers import ParsedDelta, make_parser
from shoal.services.gateway.openai.tools import ToolMode
from shoal.shared.schemas.infer import ChoiceDelta


def _chat_delta(parsed: ParsedDelta) -> DeltaMessage:
    """A parsed delta in OpenAI's streamed shape (a call's first delta has its id and name)."""
    delta = DeltaMessage(content=parsed.content) if parsed.content else DeltaMessage()
    if parsed.tool_calls:
        delta.tool_calls = [
            DeltaToolCall(index=c.index, id=c.id, type="function",
                          function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
            if c.id is not None
            else DeltaToolCall(index=c.index, function=DeltaFunctionCall(arguments=c.arguments))
            for c in parsed.tool_calls]
    return delta


@dataclass(slots=True)
class ChatResponseBuilder(ResponseBuilder[ChatChunkChoice]):
    """/v1/chat/completions: chat.completion, or chat.completion.chunk events."""

    id_prefix: ClassVar[str] = "chatcmpl"
    chunk_type: ClassVar[type[ChatCompletionChunk]] = ChatCompletionChunk
    tool_mode: ToolMode | None = None
    tool_call_parser: str | None = None
    """For tool_choice "auto": the instance's parser, learned from the engine's first reply."""
    tool_schemas: dict[str, Any] | None = None
    """The offered functions' parameters schemas by name (parsers/tool/qwen3_xml.py)."""
    parallel_tool_calls: bool = True
    introduced: set[int] = field(default_factory=set)
    """Choices whose streamed entries already named the assistant role."""

    def _state(self, index: int) -> ChoiceState:
        state = self.choices.get(index)
        if state is None:
            mode = self.tool_mode
            parser = (make_parser(mode.kind, mode.function_name, self.tool_call_parser,
                                  self.tool_schemas, self.parallel_tool_calls)
                      if mode is not None else None)
            state = self.choices[index] = ChoiceState(parser=parser)
        return state

    def _entry(self, state: ChoiceState, delta: ChoiceDelta, index: int,
               offset: int) -> ChatChunkChoice:
        parsed = (state.read(delta.text, delta.finish_reason is not None)
                  if state.parser is not None else ParsedDelta(content=delta.text))
        reason = state.reason(delta.finish_reason) if delta.finish_reason is not None else None
        if reason is not None:
            state.finish_reason, state.stop_reason = reason, delta.stop_reason
        lp = (chat_logprobs(delta.logprobs)
              if self.want_logprobs and delta.logprobs is not None else None)
        return ChatChunkChoice(index=index, delta=_chat_delta(parsed), logprobs=lp,
                               finish_reason=reason)

    def _closing(self, state: ChoiceState, index: int, reason: str) -> ChatChunkChoice:
        parsed = state.read("", is_last=True) if state.parser is not None else ParsedDelta()
        state.finish_reason = reason = state.reason(reason)
        return ChatChunkChoice(index=index, delta=_chat_delta(parsed), logprobs=None,
                               finish_reason=reason)

    def worth_sending(self, entry: ChatChunkChoice) -> bool:
        """A parser holding text back yields empty deltas: those are not sent."""
        return bool(entry.delta.model_fields_set or entry.finish_reason or entry.logprobs)

    def with_role(self, entry: ChatChunkChoice) -> ChatChunkChoice:
        """The first streamed entry of a chat choice also names the role, as vLLM sends it: with
        the first token, not before (a benchmark client times the first token from the first
        chunk that has `choices`, so an early role-only chunk would fake a tiny TTFT)."""
        if entry.index not in self.introduced:
            self.introduced.add(entry.index)
            entry.delta.role = "assistant"
            if entry.delta.content is None:
                entry.delta.content = ""
        return entry

    def learn_parser(self, name: str) -> None:
        self.tool_call_parser = name

    @staticmethod
    def _message(state: ChoiceState, text: str) -> ChatMessage:
        if state.parser is None:
            return ChatMessage(role="assistant", content=text)
        if not state.tool_calls:
            return ChatMessage(role="assistant", content=state.content)
        return ChatMessage(role="assistant",
                           content=state.content if state.content.strip() else None,
                           tool_calls=state.tool_calls)

    def final(self, prefix_text: dict[int, str] | None = None) -> ChatCompletion:
        """The non-streamed answer."""
        choices = [ChatChoice(index=index, message=self._message(state, text),
                              logprobs=(chat_logprobs(state.logprobs) if self.want_logprobs
                                        else None),
                              finish_reason=state.finish_reason or "stop")
                   for index, state, text in self._closed_choices(prefix_text)]
        return ChatCompletion(id=self.id, created=self.created, model=self.model,
                              choices=choices,
                              usage=usage_info(self.usage) if self.usage is not None else None)


@dataclass(slots=True)
class CompletionResponseBuilder(ResponseBuilder[CompletionChoice]):
    """/v1/completions: text_completion objects, streamed or whole."""

    id_prefix: ClassVar[str] = "cmpl"
    chunk_type: ClassVar[type[CompletionChunk]] = CompletionChunk

    def _entry(self, state: ChoiceState, delta: ChoiceDelta, index: int,
               offset: int) -> CompletionChoice:
        if delta.finish_reason is not None:
            state.finish_reason, state.stop_reason = delta.finish_reason, delta.stop_reason
        lp = (completion_logprobs(delta.logprobs, offset)
              if self.want_logprobs and delta.logprobs is not None else None)
        return CompletionChoice(index=index, text=delta.text, logprobs=lp,
                                finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)

    def _closing(self, state: ChoiceState, index: int, reason: str) -> CompletionChoice:
        state.finish_reason = reason
        return CompletionChoice(index=index, text="", logprobs=None, finish_reason=reason,
                                stop_reason=None)

    @staticmethod
    def echo(index: int, prompt: str) -> CompletionChoice:
        """`echo`: the prompt, streamed before the choice's first token."""
        return CompletionChoice(index=index, text=prompt, logprobs=None, finish_reason=None,
                                stop_reason=None)

    def final(self, prefix_text: dict[int, str] | None = None) -> Completion:
        """The non-streamed answer; `prefix_text` (echo) is put before each choice's text."""
        choices = [CompletionChoice(index=index, text=text,
                                    logprobs=(completion_logprobs(state.logprobs, 0)
                                              if self.want_logprobs else None),
                                    finish_reason=state.finish_reason or "stop",
                                    stop_reason=state.stop_reason)
                   for index, state, text in self._closed_choices(prefix_text)]
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices,
                          usage=usage_info(self.usage) if self.usage is not None else None)
