"""OpenAI response bodies built from the engine's stream (pure): what every answer shares.

`ResponseBuilder` keeps what each choice produced (`ChoiceState`: text, tokens, logprobs, tool
calls read out of the text by tool_parsers.py) and turns engine deltas into streamed entries;
builders.py has one builder per API, which build the typed objects of objects.py. Here too:
logprobs in each API's shape and usage with cached tokens.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from shoal.services.gateway.openai.objects import (
    ChatChunkChoice, ChatCompletionChunk, ChatLogprobs, ChatTokenLogprob, CompletionChoice,
    CompletionChunk, CompletionLogprobs, FunctionCall, PromptTokensDetails, ToolCall, TopLogprob,
    UsageInfo
)
from shoal.services.gateway.openai.tool_parsers import ParsedDelta, ToolCallParser
from shoal.services.gateway.parsers.reasoning import ThinkParser
from shoal.shared.schemas.infer import ChoiceDelta, TokenLogprobWire, Usage


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_info(usage: Usage) -> UsageInfo:
    return UsageInfo(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                     total_tokens=usage.total_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens))


def add_usage(a: Usage | None, b: Usage) -> Usage:
    if a is None:
        return b
    return Usage(prompt_tokens=a.prompt_tokens + b.prompt_tokens,
                 completion_tokens=a.completion_tokens + b.completion_tokens,
                 cached_tokens=a.cached_tokens + b.cached_tokens)


def completion_logprobs(items: list[TokenLogprobWire], offset: int) -> CompletionLogprobs:
    """The legacy completions shape: parallel lists, text offsets from `offset`."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for item in items:
        out.tokens.append(item.token)
        out.token_logprobs.append(item.logprob)
        out.top_logprobs.append({t.token: t.logprob for t in item.top} or None)
        out.text_offset.append(offset)
        offset += len(item.token)
    return out


def _top(token: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=token, logprob=logprob,
                      bytes=list(token.encode("utf-8", "replace")))


def chat_logprobs(items: list[TokenLogprobWire]) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatTokenLogprob(token=i.token, logprob=i.logprob,
                         bytes=list(i.token.encode("utf-8", "replace")),
                         top_logprobs=[_top(t.token, t.logprob) for t in i.top])
        for i in items])


@dataclass(slots=True)
class ChoiceState:
    """Everything one choice produced so far (for non-streamed answers and text offsets)."""

    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprobWire] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    parser: ToolCallParser | None = None
    """Reads tool calls out of the text (chat with tools); None = the text is the content."""
    content: str = ""
    """With a parser: the text that is not a tool call (nor reasoning)."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoner: ThinkParser | None = None
    """Splits the reasoning from the answer (chat, a model served with --reasoning-parser)."""
    reasoning: str = ""
    reasoning_tokens: int = 0
    """Tokens of the deltas that were (partly) thinking."""

    def read(self, text: str, is_last: bool) -> ParsedDelta:
        """Run the parser over a delta (and flush it on the last one); keep what it found."""
        assert self.parser is not None
        parsed = self.parser.feed(text)
        if is_last:
            tail = self.parser.finish()
            parsed.content += tail.content
            parsed.tool_calls += tail.tool_calls
        self.content += parsed.content
        for call in parsed.tool_calls:
            if call.id is not None:
                self.tool_calls.append(ToolCall(id=call.id, function=FunctionCall(
                    name=call.name or "", arguments="")))
            self.tool_calls[call.index].function.arguments += call.arguments
        return parsed

    def reason(self, reason: str) -> str:
        """OpenAI's finish_reason: "tool_calls" when the answer ended by calling tools."""
        return "tool_calls" if self.tool_calls and reason == "stop" else reason


Entry = TypeVar("Entry", ChatChunkChoice, CompletionChoice)


@dataclass(slots=True)
class ResponseBuilder(Generic[Entry]):
    """Turns engine deltas into OpenAI chunks (streaming) or one final object (not streaming).

    Choice indexes are offset per prompt for batched prompts. A streamed entry goes out as
    `chunk([with_role(entry)])` when `worth_sending(entry)`.
    """

    id_prefix: ClassVar[str]
    chunk_type: ClassVar[type[ChatCompletionChunk] | type[CompletionChunk]]
    model: str
    want_logprobs: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    choices: dict[int, ChoiceState] = field(default_factory=dict)
    usage: Usage | None = None

    def __post_init__(self) -> None:
        if not self.id:
            self.id = new_id(self.id_prefix)

    def _state(self, index: int) -> ChoiceState:
        state = self.choices.get(index)
        if state is None:
            state = self.choices[index] = ChoiceState()
        return state

    def apply(self, delta: ChoiceDelta, index: int) -> Entry:
        """Record a delta and return its streamed choice entry."""
        state = self._state(index)
        offset = len(state.text)
        state.text += delta.text
        state.num_tokens += len(delta.token_ids)
        if delta.logprobs:
            state.logprobs.extend(delta.logprobs)
        return self._entry(state, delta, index, offset)

    def finish(self, index: int, reason: str) -> Entry | None:
        """The closing entry for a choice whose finish reason came only with the end message."""
        state = self._state(index)
        if state.finish_reason is not None:
            return None
        return self._closing(state, index, reason)

    def learn_parser(self, name: str) -> None:
        """Seq 0 of a chat request with tool_choice "auto" names the instance's parser."""

    def learn_reasoning_parser(self, name: str) -> None:
        """Seq 0 of a chat request names the instance's reasoning parser, if it has one."""

    def usage_body(self, usage: Usage) -> UsageInfo:
        """The usage object of this answer (chat adds its reasoning tokens)."""
        return usage_info(usage)

    def worth_sending(self, entry: Entry) -> bool:
        return True

    def with_role(self, entry: Entry) -> Entry:
        return entry

    def chunk(self, entries: list[Entry], usage: Usage | None = None,
              with_usage: bool = False) -> Any:
        """One streamed event; `usage` (maybe None: not known yet) only `with_usage`."""
        chunk = self.chunk_type(id=self.id, created=self.created, model=self.model,
                                choices=entries)  # type: ignore[arg-type]
        if with_usage:
            chunk.usage = self.usage_body(usage) if usage is not None else None
        return chunk

    def _closed_choices(self, prefix_text: dict[int, str] | None
                        ) -> list[tuple[int, ChoiceState, str]]:
        """(index, state, text) of every choice, each closed; `prefix_text` (echo) goes first."""
        out = []
        for index in sorted(self.choices):
            state = self.choices[index]
            if state.finish_reason is None:
                self.finish(index, "stop")  # flushes what a tool-call parser still holds
            out.append((index, state, (prefix_text or {}).get(index, "") + state.text))
        return out

    def final(self, prefix_text: dict[int, str] | None = None) -> Any:
        """The non-streamed answer (ChatCompletion or Completion)."""
        raise NotImplementedError

    def _entry(self, state: ChoiceState, delta: ChoiceDelta, index: int, offset: int) -> Entry:
        raise NotImplementedError

    def _closing(self, state: ChoiceState, index: int, reason: str) -> Entry:
        raise NotImplementedError
