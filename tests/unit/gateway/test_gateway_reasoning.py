"""A chat answer through a reasoning parser (and a tool parser after it), as the gateway builds
it from the engine's deltas: streamed in any token split, the deltas add up to the non-streamed
message; reasoning tokens are counted from the deltas that were thinking; a guided answer is not
split; chat_template_kwargs reach the template and may not replace its own arguments."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from shoal.shared.errors import InvalidRequest
from shoal.services.gateway.openai.builders import ChatResponseBuilder
from shoal.services.gateway.openai.protocol import ChatCompletionRequest
from shoal.services.gateway.openai.tools import ToolMode
from shoal.shared.schemas.infer import ChoiceDelta, Usage

R1 = "Okay, 2+2.\nThat is 4 </thin k>.\n</think>\n\nThe answer is **4**."
QWEN_TOOL = ('<think>\nThe user wants weather; call the tool.\n</think>\n\n<tool_call>\n'
             '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def splits(text: str, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    out = [[text], list(text)]
    for _ in range(25):
        cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(1, 20)))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


def answer(pieces: list[str], parser: str | None, **builder: Any) -> tuple[dict, list[dict]]:
    """(the non-streamed body, the streamed chunks' choices) of one answer, each piece a token."""
    whole, stream = (ChatResponseBuilder("m", **builder), ChatResponseBuilder("m", **builder))
    chunks = []
    for b in (whole, stream):
        if parser:
            b.learn_reasoning_parser(parser)
        if builder.get("tool_mode"):
            b.learn_parser("hermes")
        for i, text in enumerate(pieces):
            last = "stop" if i == len(pieces) - 1 else None
            entry = b.apply(ChoiceDelta(index=0, text=text, token_ids=[i], finish_reason=last), 0)
            if b is stream and b.worth_sending(entry):
                chunks.append(b.chunk([b.with_role(entry)]).body()["choices"][0])
        b.usage = Usage(prompt_tokens=3, completion_tokens=len(pieces))
    return whole.final().body(), chunks


def joined(chunks: list[dict], field: str) -> str:
    return "".join(c["delta"].get(field) or "" for c in chunks)


@pytest.mark.parametrize("seed", range(4))
def test_deepseek_r1_streams_exactly_as_the_whole_answer_splits(seed: int) -> None:
    for pieces in splits(R1, seed):
        body, chunks = answer(pieces, "deepseek_r1")
        message = body["choices"][0]["message"]
        assert message["reasoning_content"] == "Okay, 2+2.\nThat is 4 </thin k>.\n"
        assert message["content"] == "\n\nThe answer is **4**."
        assert joined(chunks, "reasoning_content") == message["reasoning_content"]
        assert joined(chunks, "content") == message["content"]
        assert message["reasoning_content"] + "</think>" + message["content"] == R1
        details = body["usage"]["completion_tokens_details"]
        thinking = R1.index("</think>") + len("</think>")  # pieces up to the tag's end
        assert details["reasoning_tokens"] == sum(
            1 for i in range(len(pieces)) if len("".join(pieces[:i])) < thinking)


def test_reasoning_then_tool_calls_in_any_split() -> None:
    for pieces in splits(QWEN_TOOL, 7):
        body, chunks = answer(pieces, "qwen3", tool_mode=ToolMode("auto"))
        message = body["choices"][0]["message"]
        assert message["reasoning_content"] == "\nThe user wants weather; call the tool.\n"
        assert message["content"] is None and body["choices"][0]["finish_reason"] == "tool_calls"
        call = message["tool_calls"][0]["function"]
        assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
        assert joined(chunks, "reasoning_content") == message["reasoning_content"]
        streamed = [t for c in chunks for t in c["delta"].get("tool_calls") or []]
        assert [t["function"]["name"] for t in streamed] == ["get_weather"]


def test_without_a_parser_or_with_a_guided_answer_nothing_is_split() -> None:
    body, chunks = answer(list(R1), None)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": R1}
    assert "completion_tokens_details" not in body["usage"]
    assert not any("reasoning_content" in c["delta"] for c in chunks)
    body, _ = answer(['{"a": 1}'], "deepseek_r1", guided=True)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": '{"a": 1}'}


def test_qwen3_without_think_is_all_content_and_include_reasoning_false_drops_it() -> None:
    body, _ = answer(["Hello", "!"], "qwen3")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello!",
                                             "reasoning_content": None}
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    body, chunks = answer(["<think>", "x", "</think>", "y"], "qwen3", include_reasoning=False)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "y"}
    assert not any("reasoning_content" in c["delta"] for c in chunks)
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}


def test_a_guided_request_is_marked_and_chat_template_kwargs_travel() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"enable_thinking": False}}
    request = ChatCompletionRequest.model_validate(body)
    assert request.generate("r").chat_template_kwargs == {"enable_thinking": False}
    assert request.spec()[0] is None
    guided = ChatCompletionRequest.model_validate({**body, "response_format": {
        "type": "json_object"}})
    assert guided.spec()[0] is not None


class Template:
    def __init__(self) -> None:
        self.kwargs: dict[str, Any] = {}

    def apply_chat_template(self, messages: list[Any], **kwargs: Any) -> str:
        self.kwargs = kwargs
        return "x"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1]


def test_chat_template_kwargs_reach_the_template_but_not_its_own_arguments() -> None:
    from shoal.services.engine.input_processor import InputProcessor

    tokenizer = Template()
    inputs = InputProcessor(tokenizer=tokenizer, max_model_len=100)
    inputs.request_ids(messages=[{"role": "user", "content": "hi"}],
                       chat_template_kwargs={"enable_thinking": False})
    assert tokenizer.kwargs["enable_thinking"] is False and tokenizer.kwargs["tokenize"] is False
    for bad in ({"tokenize": True}, {"add_generation_prompt": False}, {"not a name": 1}):
        with pytest.raises(InvalidRequest) as err:
            inputs.request_ids(messages=[{"role": "user", "content": "hi"}],
                               chat_template_kwargs=bad)
        assert err.value.param == "chat_template_kwargs"
