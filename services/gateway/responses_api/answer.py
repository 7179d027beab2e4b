"""A chat answer as an OpenAI Response (pure): output items (a `message` with `output_text`,
`function_call`s), usage, status, and the streamed events in OpenAI's order (response.created,
response.in_progress, per item output_item.added, content_part.added, output_text.delta ...,
output_text.done, content_part.done, output_item.done, or function_call_arguments.delta/.done,
then response.completed), each with its sequence_number.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from shoal.services.gateway.openai.objects import ChatChunkChoice
from shoal.services.gateway.responses_api.protocol import ResponsesRequest
from shoal.shared.schemas.infer import Usage


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_id(chat_id: str) -> str:
    """The Response id of the chat answer with this id (one id in logs and traces)."""
    return "resp_" + chat_id.partition("-")[2]


def usage(used: Usage | None, reasoning_tokens: int = 0) -> dict[str, Any]:
    used = used or Usage(prompt_tokens=0, completion_tokens=0)
    return {"input_tokens": used.prompt_tokens,
            "input_tokens_details": {"cached_tokens": used.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": used.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": used.total_tokens}


@dataclass(slots=True)
class Output:
    """What the answer produced, with the ids its items are sent under."""

    message_id: str = field(default_factory=lambda: new_item_id("msg"))
    reasoning_id: str = field(default_factory=lambda: new_item_id("rs"))
    reasoning: str = ""
    """A reasoning model's reasoning (its --reasoning-parser): a `reasoning` item first; not
    part of the next turn's prompt, as chat templates drop earlier turns' reasoning."""
    reasoning_tokens: int = 0
    text: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    """function_call items: id, call_id, name, arguments."""

    def items(self) -> list[dict[str, Any]]:
        out = [reasoning_item(self.reasoning_id, self.reasoning, "completed")] \
            if self.reasoning else []
        if self.text or not self.calls:
            out.append(message_item(self.message_id, self.text, "completed"))
        out += [function_item(call, "completed") for call in self.calls]
        return out

    def assistant_message(self) -> dict[str, Any]:
        """The answer as the chat message the next turn's conversation holds."""
        message: dict[str, Any] = {"role": "assistant",
                                   "content": self.text if self.text or not self.calls else None}
        if self.calls:
            message["tool_calls"] = [{"id": c["call_id"], "type": "function", "function": {
                "name": c["name"], "arguments": c["arguments"]}} for c in self.calls]
        return message


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content if status == "completed" else []}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}


def function_item(call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": call["id"], "call_id": call["call_id"],
            "name": call["name"], "arguments": call["arguments"], "status": status}


def response_object(req: ResponsesRequest, rid: str, model: str, created: int,
                    output: Output | None, finish: str | None,
                    used: Usage | None) -> dict[str, Any]:
    """The Response: in progress (output None) or done."""
    incomplete = output is not None and finish == "length"
    status = ("in_progress" if output is None else "incomplete" if incomplete else "completed")
    return {
        "id": rid, "object": "response", "created_at": created, "model": model,
        "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {}, "output": output.items() if output else [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "text": {"format": (req.text.format.model_dump(by_alias=True, exclude_none=True)
                            if req.text and req.text.format else {"type": "text"})},
        "tool_choice": (req.tool_choice if isinstance(req.tool_choice, str) else
                        req.tool_choice.model_dump() if req.tool_choice else "auto"),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "usage": usage(used, output.reasoning_tokens) if output is not None else None,
        "user": req.user,
    }


def sse(event: dict[str, Any]) -> bytes:
    return (b"event: " + event["type"].encode() + b"\ndata: "
            + json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n")


@dataclass(slots=True)
class ResponseStream:
    """Chat chunk entries in, Responses events out (bytes to write)."""

    req: ResponsesRequest
    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    output: Output = field(default_factory=Output)
    sequence: int = 0
    index: int = -1
    """The open item's output_index (-1: none yet)."""
    open_kind: str | None = None
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    """A tool call's index among the choice's calls -> its function_call item."""

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse(event)

    def start(self) -> bytes:
        pending = response_object(self.req, self.id, self.model, self.created, None, None, None)
        return (self._event("response.created", response=pending)
                + self._event("response.in_progress", response=pending))

    def _text_ids(self) -> dict[str, Any]:
        return {"item_id": self.output.message_id, "output_index": self.index,
                "content_index": 0}

    def _close(self) -> bytes:
        kind, self.open_kind = self.open_kind, None
        if kind == "reasoning":
            rid, text = self.output.reasoning_id, self.output.reasoning
            return (self._event("response.reasoning_text.done", item_id=rid,
                                output_index=self.index, content_index=0, text=text)
                    + self._event("response.output_item.done", output_index=self.index,
                                  item=reasoning_item(rid, text, "completed")))
        if kind == "text":
            text = self.output.text
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            return (self._event("response.output_text.done", text=text, logprobs=[],
                                **self._text_ids())
                    + self._event("response.content_part.done", part=part, **self._text_ids())
                    + self._event("response.output_item.done", output_index=self.index,
                                  item=message_item(self.output.message_id, text, "completed")))
        if kind == "call":
            call = self.output.calls[-1]
            return (self._event("response.function_call_arguments.done", item_id=call["id"],
                                output_index=self.index, arguments=call["arguments"])
                    + self._event("response.output_item.done", output_index=self.index,
                                  item=function_item(call, "completed")))
        return b""

    def feed(self, entries: list[ChatChunkChoice]) -> bytes:
        out = b""
        for entry in entries:
            delta = entry.delta
            if delta.reasoning_content:
                if self.open_kind != "reasoning":
                    out += self._close()
                    self.index += 1
                    self.open_kind = "reasoning"
                    out += self._event("response.output_item.added", output_index=self.index,
                                       item=reasoning_item(self.output.reasoning_id, "",
                                                           "in_progress"))
                self.output.reasoning += delta.reasoning_content
                out += self._event("response.reasoning_text.delta", delta=delta.reasoning_content,
                                   item_id=self.output.reasoning_id, output_index=self.index,
                                   content_index=0)
            if delta.content:
                if self.open_kind != "text":
                    out += self._close()
                    self.index += 1
                    self.open_kind = "text"
                    out += self._event("response.output_item.added", output_index=self.index,
                                       item=message_item(self.output.message_id, "",
                                                         "in_progress"))
                    out += self._event("response.content_part.added", part={
                        "type": "output_text", "text": "", "annotations": [], "logprobs": []},
                        **self._text_ids())
                self.output.text += delta.content
                out += self._event("response.output_text.delta", delta=delta.content,
                                   logprobs=[], **self._text_ids())
            for tc in delta.tool_calls or []:
                function = tc.function
                if tc.id is not None:
                    out += self._close()
                    self.index += 1
                    self.open_kind = "call"
                    call = {"id": new_item_id("fc"), "call_id": tc.id,
                            "name": function.name if function and function.name else "",
                            "arguments": ""}
                    self.calls[tc.index] = call
                    self.output.calls.append(call)
                    out += self._event("response.output_item.added", output_index=self.index,
                                       item=function_item(call, "in_progress"))
                if function is not None and function.arguments and tc.index in self.calls:
                    call = self.calls[tc.index]
                    call["arguments"] += function.arguments
                    out += self._event("response.function_call_arguments.delta",
                                       item_id=call["id"], output_index=self.index,
                                       delta=function.arguments)
        return out

    def finish(self, finish: str | None, used: Usage | None, reasoning_tokens: int = 0
               ) -> tuple[bytes, dict[str, Any]]:
        """The open item's closing events; the done Response (to store, then `completed`)."""
        self.output.reasoning_tokens = reasoning_tokens
        out = self._close()
        if self.index < 0:  # nothing at all: the empty message still comes, as a whole answer
            self.index = 0
            out += self._event("response.output_item.added", output_index=0,
                               item=message_item(self.output.message_id, "", "in_progress"))
            out += self._event("response.output_item.done", output_index=0,
                               item=message_item(self.output.message_id, "", "completed"))
        done = response_object(self.req, self.id, self.model, self.created, self.output,
                               finish, used)
        return out, done

    def completed(self, done: dict[str, Any]) -> bytes:
        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        return self._event(kind, response=done)

    def error(self, message: str, code: str, param: str | None) -> bytes:
        """A failure after the stream began (the SDK raises it)."""
        return self._event("error", code=code, message=message, param=param)
