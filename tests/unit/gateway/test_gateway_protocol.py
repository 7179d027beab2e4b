"""OpenAI request validation: every bad input is InvalidRequest (400) naming its param; good input
maps onto the bus contract (SamplingOptions, GenerateRequest)."""

from __future__ import annotations

import json

import pytest

from shoal.services.gateway.json_body import MAX_JSON_DEPTH, parse_body
from shoal.services.gateway.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeBody, TokenizeBody,
)
from shoal.shared.errors import InvalidRequest

MSG = [{"role": "user", "content": "hi"}]


def chat(**fields: object) -> bytes:
    return json.dumps({"model": "m", "messages": MSG, **fields}).encode()


def completion(**fields: object) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **fields}).encode()


@pytest.mark.parametrize("raw, param", [
    (chat(max_tokens=-1), "max_tokens"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(max_completion_tokens=-5), "max_completion_tokens"),
    (chat(n=0), "n"),
    (chat(n="two"), "n"),
    (chat(temperature=-0.1), "temperature"),
    (chat(temperature=3), "temperature"),
    (chat(top_p=0), "top_p"),
    (chat(top_k=-2), "top_k"),
    (chat(min_p=1.5), "min_p"),
    (chat(presence_penalty=3), "presence_penalty"),
    (chat(frequency_penalty=-3), "frequency_penalty"),
    (chat(repetition_penalty=0), "repetition_penalty"),
    (chat(seed="abc"), "seed"),
    (chat(stop=[""]), "stop"),
    (chat(stop=["a"] * 17), "stop"),
    (chat(stop=5), "stop"),
    (chat(top_logprobs=21, logprobs=True), "top_logprobs"),
    (chat(top_logprobs=2), "top_logprobs"),
    (chat(stream_options={"include_usage": True}), "stream_options"),
    (chat(min_tokens=10, max_tokens=5), "min_tokens"),
    (json.dumps({"model": "m", "messages": []}).encode(), "messages"),
    (json.dumps({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}).encode(),
     "messages.0.role"),
    (json.dumps({"model": "m",
                 "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
     "messages.0.content"),
    (json.dumps({"messages": MSG}).encode(), "model"),
    (json.dumps({"model": "", "messages": MSG}).encode(), "model"),
    # lenient input that OpenAI and vLLM refuse (issue 15): no coercion, no overflow, no ignoring
    (chat(seed="42"), "seed"),
    (chat(seed=2**63), "seed"),
    (chat(stop_token_ids=[2**63]), "stop_token_ids.0"),
    (chat(stop_token_ids=[-1]), "stop_token_ids.0"),
    (chat(top_k=1e9), "top_k"),
    (chat(top_k=2**40), "top_k"),
    (chat(n="2"), "n"),
    (chat(stream="true"), "stream"),
    (chat(temperature="0.5"), "temperature"),
    (chat(logit_bias="garbage"), "logit_bias"),
    (chat(logit_bias={"not-a-token": 5}), "logit_bias"),
    (chat(logit_bias={"50256": 1000}), "logit_bias"),
    (chat(logit_bias={"50256": "x"}), "logit_bias.50256"),
    (chat(logit_bias={"\u0663": 5}), "logit_bias"),  # a digit, but not an ASCII one
])
def test_bad_chat_requests(raw: bytes, param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_body(raw, ChatCompletionRequest)
    assert err.value.param == param and err.value.http_status == 400


@pytest.mark.parametrize("raw, param", [
    (completion(logprobs=21), "logprobs"),
    (completion(logprobs=-1), "logprobs"),
    (completion(max_tokens=-3), "max_tokens"),
    (completion(prompt=[]), "prompt"),
    (completion(prompt=[1, -2]), "prompt"),
    (completion(prompt={"a": 1}), "prompt"),
    (completion(suffix="x"), "suffix"),
    (completion(best_of=3), "best_of"),
    (completion(echo=True, logprobs=1), "echo"),
    (completion(prompt=[1, 2**63]), "prompt"),
    (completion(prompt=[[1], [2**31]]), "prompt"),
    (completion(max_tokens=16.0), "max_tokens"),
])
def test_bad_completion_requests(raw: bytes, param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_body(raw, CompletionRequest)
    assert err.value.param == param


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe"])
def test_malformed_bodies(raw: bytes) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_body(raw, ChatCompletionRequest)
    assert err.value.code == "invalid_json"
    assert err.value.to_dict()["type"] == "invalid_request_error"


def test_chat_maps_to_generate_request() -> None:
    body = parse_body(chat(max_completion_tokens=7, max_tokens=99, n=2, stop="x", temperature=0,
                           seed=3,
                           logprobs=True, top_logprobs=4, top_k=-1, ignore_eos=True, user="u",
                           unknown_field=1, stream=True, stream_options={"include_usage": True}),
                      ChatCompletionRequest)
    req = body.generate("r1")
    s = req.sampling
    assert (s.max_tokens, s.n, s.stop, s.temperature, s.seed, s.logprobs, s.top_k,
            s.ignore_eos) == \
        (7, 2, ["x"], 0.0, 3, 4, 0, True)
    assert req.messages is not None and req.messages[0].content == "hi" and req.prompt is None
    assert body.include_usage
    content = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})
    parts = parse_body(raw.encode(), ChatCompletionRequest)
    assert parts.generate("r").messages[0].content == "a\nb"  # vLLM joins text parts so
    assert parse_body(chat(), ChatCompletionRequest).generate("r").sampling.max_tokens is None


def test_completion_prompts_and_defaults() -> None:
    body = parse_body(completion(), CompletionRequest)
    assert body.prompts() == ["hi"] and body.generate("r", "hi").sampling.max_tokens == 16
    assert parse_body(completion(prompt=[1, 2, 3]), CompletionRequest).prompts() == [[1, 2, 3]]
    batch = parse_body(completion(prompt=["a", "b"], logprobs=2), CompletionRequest)
    assert batch.prompts() == ["a", "b"] and batch.generate("r", "a").sampling.logprobs == 2
    ids = parse_body(completion(prompt=[[1], [2, 3]]), CompletionRequest)
    assert ids.generate("r", [2, 3]).prompt_token_ids == [2, 3]


def test_tokenize_bodies() -> None:
    with pytest.raises(InvalidRequest):
        parse_body(b'{"model": "m"}', TokenizeBody)
    assert parse_body(b'{"model": "m", "prompt": "x"}', TokenizeBody).prompt == "x"
    with pytest.raises(InvalidRequest) as err:
        parse_body(b'{"model": "m", "tokens": ["a"]}', DetokenizeBody)
    assert err.value.param == "tokens.0"


def test_deep_nesting_is_a_400_not_a_recursion_error() -> None:
    deep = b'{"model": "m", "messages": ' + b"[" * 10000 + b"]" * 10000 + b"}"
    for model in (ChatCompletionRequest, CompletionRequest, TokenizeBody):
        with pytest.raises(InvalidRequest) as err:
            parse_body(deep, model)
        assert err.value.code == "invalid_json" and "nests deeper" in err.value.message
    schema: dict = {"type": "object"}
    for _ in range(MAX_JSON_DEPTH):  # just under json.loads' limit, over ours
        schema = {"type": "object", "properties": {"a": schema}}
    raw = chat(response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                        "schema": schema}})
    with pytest.raises(InvalidRequest, match="nests deeper"):
        parse_body(raw, ChatCompletionRequest)
    shallow = {"type": "object", "properties": {"a": {"type": "string"}}}
    ok = chat(response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                       "schema": shallow}})
    assert parse_body(ok, ChatCompletionRequest).response_format is not None


def test_integral_ids_and_seeds_in_range_pass() -> None:
    body = parse_body(chat(seed=-(2**63), stop_token_ids=[0, 2**31 - 1], top_k=-1),
                      ChatCompletionRequest)
    assert body.generate("r").sampling.stop_token_ids == [0, 2**31 - 1]
    assert parse_body(chat(logit_bias={}), ChatCompletionRequest).logit_bias == {}
    biased = parse_body(chat(logit_bias={"50256": -100, "7": 2.5}), ChatCompletionRequest)
    assert biased.generate("r").sampling.logit_bias == {50256: -100.0, 7: 2.5}


def test_lone_surrogates_are_a_400_not_an_encoding_error() -> None:
    """json.loads takes "\\ud800" alone, but nothing can encode it for the bus (found by the
    fuzzer); a surrogate pair is one real character and passes."""
    for raw in (b'{"model": "m\\ud890", "prompt": "hi"}', b'{"model": "m", "prompt": "\\udc00"}',
                b'{"model": "m", "prompt": "hi", "\\ud800": 1}'):
        with pytest.raises(InvalidRequest, match="surrogate"):
            parse_body(raw, CompletionRequest)
    body = parse_body(b'{"model": "m", "prompt": "\\ud83d\\ude42"}', CompletionRequest)
    assert body.prompt == "\U0001f642"


def test_tokenize_with_no_messages_is_a_400() -> None:
    """Found by the fuzzer: `messages: []` built a chat request that refused it: a 500."""
    with pytest.raises(InvalidRequest) as err:
        parse_body(b'{"model": "m", "messages": []}', TokenizeBody)
    assert err.value.param == "messages"
