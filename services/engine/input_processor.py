"""InputProcessor: a request's input as token ids, one way for every front end: the offline `LLM`
(generate, chat), the engine's NATS adapter (generate, tokenize: server/handlers.py) and the
embedding engine and its adapter (embed, tokenize). It owns the prompt policy:

- chat templates: a conversation (and the OpenAI-style tools offered) rendered with the model's
  template (or the configured `chat_template`); a template that fails on the input is a 400;
- tokenization of text (special tokens as asked), and the forms a prompt takes (text, token ids,
  vLLM's {"prompt": ...} / {"prompt_token_ids": ...});
- size: a text that cannot fit max_model_len whatever its tokens is refused before tokenizing
  (tokenizing a 4 MiB prompt takes seconds, to end in "too long" anyway);
- embeddings: truncation (vLLM's truncate_prompt_tokens) and the length and vocabulary checks.

What a generation must fit (the prompt plus max_tokens, the KV pool) is the core's one check
when the request is processed (core/request_checks.py). A top-level module, torch-free and handed
its tokenizer: the front ends, the server and the embedding engine (model side) all use it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from shoal.shared.errors import InvalidRequest

Message = dict[str, Any]
PromptType = str | list[int] | dict[str, Any]
"""A string, a list of token ids, or {"prompt": str} / {"prompt_token_ids": [...]} as vLLM takes."""


class Prompt(NamedTuple):
    text: str | None
    """The prompt as text (None when it came as token ids only)."""
    token_ids: list[int]


@dataclass(kw_only=True)
class InputProcessor:
    tokenizer: Any
    max_model_len: int
    chat_template: str | None = None
    """A Jinja template used instead of the tokenizer's (vLLM's --chat-template)."""
    vocab_size: int | None = None
    """Token ids of embedding inputs must be below it (generation's are checked by the core)."""
    max_token_bytes: int | None = None
    """The longest token of the vocabulary in bytes; found at the first text long enough to
    need it (`longest_token_bytes`)."""

    # ------------------------------------------------------------------ size
    def longest_token_bytes(self) -> int:
        if self.max_token_bytes is None:
            pieces = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
            self.max_token_bytes = max(len(p.encode()) for p in pieces if p)
        return self.max_token_bytes

    def check_size(self, texts: Iterable[str], param: str) -> None:
        """Refuse, before tokenizing, texts that cannot fit the context whatever their tokens.
        Twice the bound, so a normalizer that shortens text never refuses a prompt that fits."""
        size = sum(len(t.encode()) for t in texts)
        if size <= 2 * self.max_model_len:  # every token is at least a byte: fits the bound
            return
        limit = 2 * self.longest_token_bytes() * self.max_model_len
        if size > limit:
            raise InvalidRequest(
                f"the prompt is {size} bytes: more tokens than this model's context "
                f"(max_model_len {self.max_model_len}) can hold whatever they are "
                f"(refused above {limit} bytes, without tokenizing)", param=param)

    # ------------------------------------------------------------------ text and chat
    def encode(self, text: str, *, add_special_tokens: bool = True,
               param: str = "prompt") -> list[int]:
        """Token ids of one text (refused first when it is too large to fit)."""
        self.check_size([text], param)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def chat(self, messages: Sequence[Message], *, tools: list[dict[str, Any]] | None = None,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             chat_template_kwargs: Mapping[str, Any] | None = None) -> Prompt:
        """A conversation rendered with the chat template, and its token ids. A template that
        fails on the input is the request's fault: InvalidRequest naming `messages`.
        `chat_template_kwargs` are more variables for the template (vLLM's, e.g.
        {"enable_thinking": False}); they may not replace the rendering's own arguments."""
        if not messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        extra = dict(chat_template_kwargs or {})
        check_template_kwargs(extra)
        self.check_size((c for m in messages if isinstance(c := m.get("content"), str)),
                        "messages")
        try:
            text = self.tokenizer.apply_chat_template(
                [template_message(m) for m in messages], tools=tools, tokenize=False,
                chat_template=chat_template or self.chat_template,
                add_generation_prompt=add_generation_prompt, **extra)
        except Exception as exc:  # noqa: BLE001 - jinja raises anything the template does
            raise InvalidRequest(f"cannot apply the chat template: {exc}",
                                 param="messages") from None
        return Prompt(text, list(self.tokenizer.encode(text, add_special_tokens=False)))

    # ------------------------------------------------------------------ generation
    def prompt(self, prompt: PromptType) -> Prompt:
        """One prompt of the offline LLM, in any form vLLM takes."""
        if isinstance(prompt, str):
            return Prompt(prompt, self.encode(prompt))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return Prompt(prompt.get("prompt"), list(prompt["prompt_token_ids"]))
            if "prompt" in prompt:
                return self.prompt(str(prompt["prompt"]))
        elif isinstance(prompt, list):
            return Prompt(None, list(prompt))
        raise InvalidRequest(f"a prompt must be a string, token ids or a dict, got {prompt!r}",
                             param="prompt")

    def request_ids(self, *, prompt: str | None = None,
                    prompt_token_ids: Sequence[int] | None = None,
                    messages: Sequence[Message] | None = None,
                    tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True,
                    add_special_tokens: bool = True,
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """A served request's prompt (chat messages, token ids or text) as token ids; the
        engine checks their range when the request is opened."""
        if messages is not None:
            return self.chat(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                             chat_template_kwargs=chat_template_kwargs).token_ids
        if prompt_token_ids is not None:
            return list(prompt_token_ids)
        if prompt is None:
            raise InvalidRequest("give a prompt, prompt token ids or messages", param="prompt")
        ids = self.encode(prompt, add_special_tokens=add_special_tokens)
        if not ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        return ids

    # ------------------------------------------------------------------ embeddings
    def detokenize(self, token_ids: Sequence[int], vocab_bound: int) -> str:
        """Token ids back to text (/detokenize), at most max_model_len of them (the longest
        sequence this model holds: the tokenizer's decode holds the GIL, a million ids for
        seconds), each below `vocab_bound`."""
        if len(token_ids) > self.max_model_len:
            raise InvalidRequest(f"{len(token_ids)} tokens: this model detokenizes at most "
                                 f"{self.max_model_len} at once (its max_model_len)",
                                 param="tokens")
        if any(not 0 <= t < vocab_bound for t in token_ids):
            raise InvalidRequest(f"token ids must be in [0, {vocab_bound})", param="tokens")
        return self.tokenizer.decode(list(token_ids))

    def embedding_inputs(self, texts: Sequence[str] | None = None,
                         token_ids: Sequence[Sequence[int]] | None = None,
                         truncate: int | None = None) -> list[list[int]]:
        """Token ids of embedding inputs, texts with the model's special tokens ([CLS] ...
        [SEP]); `truncate` keeps at most that many (vLLM's truncate_prompt_tokens, -1 =
        max_model_len). Unchecked: `check_embedding_inputs`."""
        if token_ids is not None:
            return [self.truncate(list(x), truncate) for x in token_ids]
        if texts is None:
            raise InvalidRequest("give texts or token ids", param="input")
        if truncate is None:  # a truncated text may be of any length
            for text in texts:
                self.check_size([text], "input")
        ids = self.tokenizer(list(texts), add_special_tokens=True)["input_ids"]
        return [self.truncate(list(x), truncate) for x in ids]

    def pair_inputs(self, text_1: Sequence[str], text_2: Sequence[str],
                    truncate: int | None = None) -> list[tuple[list[int], list[int]]]:
        """A cross-encoder's inputs: each (query, document) pair as one sequence ([CLS] a [SEP]
        b [SEP]) with its token types (0 for a, 1 for b), as the tokenizer pairs them. With
        `truncate` (-1: max_model_len) the longer text is cut first (the tokenizer's
        'longest_first'); unset, a pair over the limit is a 400 when checked."""
        if truncate is None:  # a truncated pair may be of any length
            for a, b in zip(text_1, text_2):
                self.check_size([a, b], "documents")
        kwargs: dict[str, Any] = {}
        if truncate is not None:
            keep = self.max_model_len if truncate < 0 else min(truncate, self.max_model_len)
            kwargs = {"truncation": "longest_first", "max_length": keep}
        enc = self.tokenizer(list(text_1), list(text_2), add_special_tokens=True,
                             return_token_type_ids=True, **kwargs)
        return [(list(ids), list(types))
                for ids, types in zip(enc["input_ids"], enc["token_type_ids"])]

    def truncate(self, ids: list[int], truncate: int | None) -> list[int]:
        if truncate is None:
            return ids
        keep = self.max_model_len if truncate < 0 else min(truncate, self.max_model_len)
        if len(ids) <= keep:
            return ids
        # keep the closing special token, as a tokenizer's truncation does
        return ids[:keep - 1] + ids[-1:] if keep > 1 else ids[:keep]

    def check_embedding_inputs(self, batch: Sequence[Sequence[int]],
                               param: str = "input") -> None:
        """400 for an empty input, a token out of the vocabulary, or one too long."""
        for i, ids in enumerate(batch):
            if not ids:
                raise InvalidRequest(f"input {i} is empty", param=param)
            if len(ids) > self.max_model_len:
                raise InvalidRequest(
                    f"input {i} has {len(ids)} tokens; this model's maximum is "
                    f"{self.max_model_len}. Shorten it (or send truncate_prompt_tokens)",
                    param=param, code="context_length_exceeded")
            if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in ids):
                raise InvalidRequest(f"input {i}: token ids must be in [0, {self.vocab_size})",
                                     param=param)


RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
"""apply_chat_template's own arguments: a request's chat_template_kwargs may not set them."""


def check_template_kwargs(kwargs: Mapping[str, Any]) -> None:
    """400 (param chat_template_kwargs) for a key that is no template variable."""
    bad = sorted(k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS or not k.isidentifier())
    if bad:
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(bad)}: they are the "
                             f"rendering's own arguments, not template variables",
                             param="chat_template_kwargs")


def template_message(message: Mapping[str, Any]) -> Message:
    """A message as chat templates expect it: always a `content` ("" for none: clients send an
    assistant tool-call turn back with content null, and templates read message['content'], as
    vLLM renders it), and tool call arguments as a dict, not JSON text (transformers'
    convention, which vLLM follows)."""
    message = dict(message)
    if message.get("content") is None:
        message["content"] = ""
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
