"""OpenAI response bodies built from the engine's stream (pure): completion and chat objects,
their streamed chunks, logprobs in each API's shape, usage with cached tokens, and tool calls
read out of the text (tool_parsers.py) as `message.tool_calls` or streamed tool_call deltas.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from shoal.services.gateway.openai.tool_parsers import ParsedDelta, ToolCallParser, make_parser
from shoal.services.gateway.openai.tools import ToolMode
from shoal.shared.schemas.infer import ChoiceDelta, TokenLogprobWire, Usage

JSON = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_body(usage: Usage) -> JSON:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def add_usage(a: Usage | None, b: Usage) -> Usage:
    if a is None:
        return b
    return Usage(prompt_tokens=a.prompt_tokens + b.prompt_tokens,
                 completion_tokens=a.completion_tokens + b.completion_tokens,
                 cached_tokens=a.cached_tokens + b.cached_tokens)


def completion_logprobs(items: list[TokenLogprobWire], offset: int) -> JSON:
    """The legacy completions shape: parallel lists, text offsets from `offset`."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for item in items:
        tokens.append(item.token)
        token_logprobs.append(item.logprob)
        tops.append({t.token: t.logprob for t in item.top} or None)
        offsets.append(offset)
        offset += len(item.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def _token_entry(token: str, logprob: float) -> JSON:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "replace"))}


def chat_logprobs(items: list[TokenLogprobWire]) -> JSON:
    return {"content": [{**_token_entry(i.token, i.logprob),
                         "top_logprobs": [_token_entry(t.token, t.logprob) for t in i.top]}
                        for i in items]}


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
    """With a parser: the text that is not a tool call."""
    tool_calls: list[JSON] = field(default_factory=list)

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
                self.tool_calls.append({"id": call.id, "type": "function",
                                        "function": {"name": call.name, "arguments": ""}})
            self.tool_calls[call.index]["function"]["arguments"] += call.arguments
        return parsed

    def reason(self, reason: str) -> str:
        """OpenAI's finish_reason: "tool_calls" when the answer ended by calling tools."""
        return "tool_calls" if self.tool_calls and reason == "stop" else reason


def _chat_delta(parsed: ParsedDelta) -> JSON:
    """A parsed delta in OpenAI's streamed shape (a call's first delta has its id and name)."""
    payload: JSON = {"content": parsed.content} if parsed.content else {}
    if parsed.tool_calls:
        payload["tool_calls"] = [
            {"index": c.index, "id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} if c.id is not None
            else {"index": c.index, "function": {"arguments": c.arguments}}
            for c in parsed.tool_calls]
    return payload


@dataclass(slots=True)
class ResponseBuilder:
    """Turns engine deltas into OpenAI chunks (streaming) or one final object (not streaming).

    `kind` is "chat" or "completion"; choice indexes are offset per prompt for batched prompts.
    """

    kind: str
    model: str
    want_logprobs: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    choices: dict[int, ChoiceState] = field(default_factory=dict)
    usage: Usage | None = None
    tool_mode: ToolMode | None = None
    tool_call_parser: str | None = None
    """For tool_choice "auto": the instance's parser, learned from the engine's first reply."""
    introduced: set[int] = field(default_factory=set)
    """Chat choices whose streamed entries already named the assistant role."""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = new_id("chatcmpl" if self.kind == "chat" else "cmpl")

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def _state(self, index: int) -> ChoiceState:
        state = self.choices.get(index)
        if state is None:
            mode = self.tool_mode
            parser = (make_parser(mode.kind, mode.function_name, self.tool_call_parser)
                      if mode is not None else None)
            state = self.choices[index] = ChoiceState(parser=parser)
        return state

    def apply(self, delta: ChoiceDelta, index: int) -> JSON:
        """Record a delta and return its streamed choice entry."""
        state = self._state(index)
        offset = len(state.text)
        state.text += delta.text
        state.num_tokens += len(delta.token_ids)
        if delta.logprobs:
            state.logprobs.extend(delta.logprobs)
        parsed = (state.read(delta.text, delta.finish_reason is not None)
                  if state.parser is not None else ParsedDelta(content=delta.text))
        reason = state.reason(delta.finish_reason) if delta.finish_reason is not None else None
        if reason is not None:
            state.finish_reason, state.stop_reason = reason, delta.stop_reason
        lp: JSON | None = None
        if self.want_logprobs and delta.logprobs is not None:
            lp = (chat_logprobs(delta.logprobs) if self.kind == "chat"
                  else completion_logprobs(delta.logprobs, offset))
        if self.kind == "chat":
            return {"index": index, "delta": _chat_delta(parsed), "logprobs": lp,
                    "finish_reason": reason}
        return {"index": index, "text": delta.text, "logprobs": lp,
                "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason}

    def finish(self, index: int, reason: str) -> JSON | None:
        """The closing entry for a choice whose finish reason came only with the end message."""
        state = self._state(index)
        if state.finish_reason is not None:
            return None
        parsed = state.read("", is_last=True) if state.parser is not None else ParsedDelta()
        state.finish_reason = reason = state.reason(reason)
        if self.kind == "chat":
            return {"index": index, "delta": _chat_delta(parsed), "logprobs": None,
                    "finish_reason": reason}
        return {"index": index, "text": "", "logprobs": None, "finish_reason": reason,
                "stop_reason": None}

    def with_role(self, entry: JSON) -> JSON:
        """The first streamed entry of a chat choice also names the role, as vLLM sends it: with
        the first token, not before (a benchmark client times the first token from the first
        chunk that has `choices`, so an early role-only chunk would fake a tiny TTFT)."""
        index = entry["index"]
        if self.kind == "chat" and index not in self.introduced:
            self.introduced.add(index)
            entry["delta"] = {"role": "assistant", "content": "", **entry["delta"]}
        return entry

    def chunk(self, entries: list[JSON], usage: Usage | None = None,
              with_usage: bool = False) -> JSON:
        body: JSON = {"id": self.id,
                      "object": self.object_name + ("" if self.kind != "chat" else ".chunk"),
                      "created": self.created, "model": self.model, "choices": entries}
        if with_usage:
            body["usage"] = usage_body(usage) if usage is not None else None
        return body

    @staticmethod
    def _message(state: ChoiceState, text: str) -> JSON:
        if state.parser is None:
            return {"role": "assistant", "content": text}
        if not state.tool_calls:
            return {"role": "assistant", "content": state.content}
        return {"role": "assistant", "content": state.content if state.content.strip() else None,
                "tool_calls": state.tool_calls}

    def final(self, prefix_text: dict[int, str] | None = None) -> JSON:
        """The non-streamed answer; `prefix_text` (echo) is put before each choice's text."""
        entries: list[JSON] = []
        for index in sorted(self.choices):
            state = self.choices[index]
            if state.finish_reason is None:
                self.finish(index, "stop")  # flushes what a tool-call parser still holds
            text = (prefix_text or {}).get(index, "") + state.text
            if self.kind == "chat":
                lp = chat_logprobs(state.logprobs) if self.want_logprobs else None
                entries.append({"index": index, "message": self._message(state, text),
                                "logprobs": lp, "finish_reason": state.finish_reason or "stop"})
            else:
                lp = completion_logprobs(state.logprobs, 0) if self.want_logprobs else None
                entries.append({"index": index, "text": text, "logprobs": lp,
                                "finish_reason": state.finish_reason or "stop",
                                "stop_reason": state.stop_reason})
        body: JSON = {"id": self.id, "object": self.object_name, "created": self.created,
                      "model": self.model, "choices": entries}
        body["usage"] = usage_body(self.usage) if self.usage is not None else None
        return body
