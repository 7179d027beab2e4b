"""The InputProcessor, the one owner of request input: every front end's prompt goes through the
same rules (no model: a tokenizer of whitespace-separated words)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from shoal.services.engine.input_processor import InputProcessor
from shoal.shared.errors import InvalidRequest


class WordTokenizer:
    """One id per word (its length), BOS 0 when special tokens are asked; a template that joins
    the contents, and fails on a message without a role."""

    def __init__(self) -> None:
        self.encoded: list[str] = []

    def __len__(self) -> int:
        return 10

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return ["x" * i for i in ids]  # the longest token is 9 bytes

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded.append(text)
        return ([0] if add_special_tokens else []) + [len(w) for w in text.split()]

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict[str, Any]:
        return {"input_ids": [[0, *self.encode(t, False), 1] for t in texts]}

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        return " ".join(f"{m['role']}: {m['content']}" for m in messages)


def processor(**kw: Any) -> InputProcessor:
    return InputProcessor(tokenizer=WordTokenizer(), max_model_len=10, **kw)


def test_every_front_ends_form_is_tokenized_alike() -> None:
    p = processor()
    assert p.prompt("a bb") == ("a bb", [0, 1, 2])  # LLM.generate
    assert p.prompt({"prompt_token_ids": [5, 6]}) == (None, [5, 6])
    assert p.prompt({"prompt": "ccc"}) == ("ccc", [0, 3])
    assert p.request_ids(prompt="a bb") == [0, 1, 2]  # the NATS adapter
    assert p.request_ids(prompt="a bb", add_special_tokens=False) == [1, 2]
    assert p.request_ids(prompt_token_ids=[7]) == [7]
    chat = p.chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}])
    assert chat.text == "user: hi assistant: " and chat.token_ids == [5, 2, 10]
    assert p.request_ids(messages=[{"role": "user", "content": "hi"}]) == [5, 2]
    with pytest.raises(InvalidRequest, match="the prompt is empty"):
        p.request_ids(prompt=" ", add_special_tokens=False)
    with pytest.raises(InvalidRequest, match="give a prompt"):
        p.request_ids()
    with pytest.raises(InvalidRequest) as err:
        p.chat([{"content": "no role"}])
    assert err.value.param == "messages" and "chat template" in err.value.message


def test_text_that_cannot_fit_is_refused_before_tokenizing_in_every_front_end() -> None:
    """max_model_len 10, tokens of at most 9 bytes: over 180 bytes cannot fit."""
    p = processor()
    tokenizer = p.tokenizer
    for ask, param in ((lambda: p.prompt("x" * 181), "prompt"),
                       (lambda: p.request_ids(prompt="x" * 181), "prompt"),
                       (lambda: p.chat([{"role": "user", "content": "x" * 181}]), "messages"),
                       (lambda: p.embedding_inputs(["x" * 181]), "input")):
        with pytest.raises(InvalidRequest) as err:
            ask()
        assert err.value.param == param and "without tokenizing" in err.value.message
    assert tokenizer.encoded == []
    assert p.prompt("x" * 180).token_ids == [0, 180]
    # truncated embedding inputs may be of any length
    assert p.embedding_inputs(["a " * 100], truncate=-1) == [[0] + [1] * 8 + [1]]


def test_embedding_inputs_are_truncated_and_checked() -> None:
    p = processor(vocab_size=50)
    assert p.embedding_inputs(token_ids=[[0, 1, 2, 3, 9]], truncate=3) == [[0, 1, 9]]
    assert p.embedding_inputs(["a bb"]) == [[0, 1, 2, 1]]
    p.check_embedding_inputs([[1, 2]])
    for bad, what in (([[]], "empty"), ([[1] * 11], "maximum is 10"), ([[50]], "[0, 50)")):
        with pytest.raises(InvalidRequest, match=re.escape(what)):
            p.check_embedding_inputs(bad)
    with pytest.raises(InvalidRequest, match="give texts or token ids"):
        p.embedding_inputs()
