"""Chat prompts: a conversation (and the tools offered) rendered with the model's chat template,
the same way for the offline `LLM.chat` and the served chat completions.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from shoal.shared.errors import InvalidRequest

Message = dict[str, Any]


def render_chat(tokenizer: Any, messages: list[Message], *,
                tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True,
                chat_template: str | None = None) -> tuple[str, list[int]]:
    """(the prompt text, its token ids). A template that fails on the input is the request's
    fault: InvalidRequest naming `messages`."""
    if not messages:
        raise InvalidRequest("messages must not be empty", param="messages")
    try:
        text = tokenizer.apply_chat_template([template_message(m) for m in messages], tools=tools,
                                             tokenize=False, chat_template=chat_template,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # noqa: BLE001 - jinja raises anything the template does
        raise InvalidRequest(f"cannot apply the chat template: {exc}", param="messages") from None
    return text, list(tokenizer.encode(text, add_special_tokens=False))


def template_message(message: Message) -> Message:
    """A message as chat templates expect it: always a `content` ("" for none: clients send an
    assistant tool-call turn back with content null, and templates read message['content'], as
    vLLM renders it), and tool call arguments as a dict, not JSON text (transformers'
    convention, which vLLM follows)."""
    if message.get("content") is None:
        message = {**message, "content": ""}
    if not message.get("tool_calls"):
        return message
    message = copy.deepcopy(message)
    for call in message["tool_calls"]:
        function = call.get("function") or {}
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                pass  # not JSON: the template gets the text as sent
    return message
