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
    CompletionChoice, CompletionChunk, CompletionTokensDetails, DeltaFunctionCall, DeltaMessage,
    DeltaToolCall, UsageInfo
)
from shoal.services.gateway.openai.responses import (
    ChoiceState, ResponseBuilder, chat_logprobs, completion_logprobs, usage_info
)
from shoal.services.gateway.openai.tool_parsers import ParsedDelta, make_parser
from shoal.services.gateway.openai.tools import ToolMode
from shoal.services.gateway.parsers.reasoning import reasoning_parser
from shoal.shared.schemas.infer import ChoiceDelta, Usage


def _chat_delta(parsed: ParsedDelta, reasoning: str = "") -> DeltaMessage:
    """A parsed delta in OpenAI's streamed shape (a call's first delta has its id and name)."""
    delta = DeltaMessage(content=parsed.content) if parsed.content else DeltaMessage()
    if reasoning:
        delta.reasoning_content = reasoning
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
    reasoning_parser: str | None = None
    """The instance's reasoning parser, learned from the engine's first reply."""
    include_reasoning: bool = True
    """vLLM's include_reasoning: false leaves the reasoning out (it is still split off)."""
    guided: bool = False
    """The output is constrained from its first token (tool_choice required / named,
    response_format): the model cannot think first, so nothing is split off as reasoning."""
    introduced: set[int] = field(default_factory=set)
    """Choices whose streamed entries already named the assistant role."""

    def _state(self, index: int) -> ChoiceState:
        state = self.choices.get(index)
        if state is None:
            mode = self.tool_mode
            parser = (make_parser(mode.kind, mode.function_name, self.tool_call_parser,
                                  self.tool_schemas, self.parallel_tool_calls)
                      if mode is not None else None)
            reasoner = (reasoning_parser(self.reasoning_parser)
                        if self.reasoning_parser is not None and not self.guided else None)
            state = self.choices[index] = ChoiceState(parser=parser, reasoner=reasoner)
        return state

    def _split(self, state: ChoiceState, text: str, is_last: bool,
               num_tokens: int = 0) -> tuple[ParsedDelta, str]:
        """A delta's text through the reasoning parser, then the tool-call parser: (content and
        calls, reasoning); the last one flushes what both hold back."""
        reasoning = ""
        if state.reasoner is not None:
            split = state.reasoner.feed(text)
            if is_last:
                tail = state.reasoner.finish()
                split.reasoning += tail.reasoning
                split.content += tail.content
            if split.thought:
                state.reasoning_tokens += num_tokens
            state.reasoning += split.reasoning
            text, reasoning = split.content, split.reasoning
        if state.parser is not None:
            return state.read(text, is_last), reasoning
        if state.reasoner is not None:
            state.content += text
        return ParsedDelta(content=text), reasoning

    def _entry(self, state: ChoiceState, delta: ChoiceDelta, index: int,
               offset: int) -> ChatChunkChoice:
        parsed, reasoning = self._split(state, delta.text, delta.finish_reason is not None,
                                        len(delta.token_ids))
        reason = state.reason(delta.finish_reason) if delta.finish_reason is not None else None
        if reason is not None:
            state.finish_reason, state.stop_reason = reason, delta.stop_reason
        lp = (chat_logprobs(delta.logprobs)
              if self.want_logprobs and delta.logprobs is not None else None)
        return ChatChunkChoice(index=index, delta=self._delta(parsed, reasoning), logprobs=lp,
                               finish_reason=reason)

    def _closing(self, state: ChoiceState, index: int, reason: str) -> ChatChunkChoice:
        parsed, reasoning = self._split(state, "", is_last=True)
        state.finish_reason = reason = state.reason(reason)
        return ChatChunkChoice(index=index, delta=self._delta(parsed, reasoning), logprobs=None,
                               finish_reason=reason)

    def _delta(self, parsed: ParsedDelta, reasoning: str) -> DeltaMessage:
        return _chat_delta(parsed, reasoning if self.include_reasoning else "")

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

    def learn_reasoning_parser(self, name: str) -> None:
        self.reasoning_parser = name

    def usage_body(self, usage: Usage) -> UsageInfo:
        """With a reasoning parser, completion_tokens_details.reasoning_tokens too."""
        info = usage_info(usage)
        split = [s for s in self.choices.values() if s.reasoner is not None]
        if split:
            info.completion_tokens_details = CompletionTokensDetails(
                reasoning_tokens=sum(s.reasoning_tokens for s in split))
        return info

    def _message(self, state: ChoiceState, text: str) -> ChatMessage:
        if state.parser is None and state.reasoner is None:
            return ChatMessage(role="assistant", content=text)
        fields: dict[str, Any] = {"content": state.content}
        if state.tool_calls:
            fields = {"content": state.content if state.content.strip() else None,
                      "tool_calls": state.tool_calls}
        if state.reasoner is not None:  # vLLM's shape: null for a part that is empty
            fields["content"] = fields["content"] or None
            if self.include_reasoning:
                fields["reasoning_content"] = state.reasoning or None
        return ChatMessage(role="assistant", **fields)

    def final(self, prefix_text: dict[int, str] | None = None) -> ChatCompletion:
        """The non-streamed answer."""
        choices = [ChatChoice(index=index, message=self._message(state, text),
                              logprobs=(chat_logprobs(state.logprobs) if self.want_logprobs
                                        else None),
                              finish_reason=state.finish_reason or "stop")
                   for index, state, text in self._closed_choices(prefix_text)]
        return ChatCompletion(id=self.id, created=self.created, model=self.model,
                              choices=choices,
                              usage=self.usage_body(self.usage) if self.usage is not None
                              else None)


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
