"""Anthropic's Messages API through the whole stack (gateway -> NATS -> engine process running
SmolLM2), driven with the official `anthropic` SDK against a gateway that requires keys: answers
equal to the same chat sent to /v1/chat/completions (greedy), streaming, stop sequences,
count_tokens, tool use and tool results, errors in Anthropic's shape, `x-api-key` as well as
Bearer auth under the same key, its limits and its usage, the requests in /metrics, and their
GenAI spans."""

from __future__ import annotations

import asyncio
import secrets
import uuid

import aiohttp
import anthropic
import openai
import pytest

from shoal.services.engine.model_prep import smollm2_gguf_path
from shoal.shared.embedded import free_port
from shoal.shared.schemas.registry import ApiKeyCreate, ApiKeyScope, KeyLimit, ModelCreate
from tests.e2e.test_key_quota_serving import spent
from tests.e2e.test_serving import ENGINE_ARGS, gateway_traces, running_instance  # noqa: F401
from tests.integration.conftest import make_settings, running_services

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SYSTEM = "You are a geography teacher. Answer in one sentence."
ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}
"""Sampling knobs ride in extra_body: this SDK's create() no longer takes them (the API does)."""
WEATHER = {"name": "get_weather", "description": "The weather in a city now",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}


@pytest.fixture(scope="module")
async def stack(servers, tmp_path_factory):
    """A gateway that requires keys, SmolLM2 served with the hermes tool-call parser, and an
    inference key with a limit (so each request is admitted and recorded by the registry)."""
    settings = make_settings(servers, tmp_path_factory.mktemp("anthropic-e2e"),
                             heartbeat_timeout=10.0, gateway_port=free_port(None),
                             scheduler_interval=1.0, gateway_engine_dead_after=2.0,
                             require_api_key=True)
    tag = uuid.uuid4().hex[:6]
    async with running_services(settings, worker={"worker_name": f"anthropic-{tag}"},
                                gateway={}, name="anthropic-e2e") as stack:
        client = stack.client
        model = await client.create_model(ModelCreate(
            name=f"smol-{tag}", source=str(smollm2_gguf_path()), device="cpu",
            max_model_len=512, worker_selector=stack.selector,
            engine_args={**ENGINE_ARGS, "tool_call_parser": "hermes"}))
        await running_instance(client, model.id)
        key = await client.create_key(ApiKeyCreate(
            name=f"a-{tag}", scope=ApiKeyScope.INFERENCE, limits=[KeyLimit(rpm=10000)]))
        yield stack.url, model.name, key, client


def sdk(url: str, key: str | None = None, token: str | None = None) -> anthropic.AsyncAnthropic:
    """The SDK as users build it: `api_key` sends x-api-key, `auth_token` sends Bearer."""
    return anthropic.AsyncAnthropic(base_url=url, api_key=key, auth_token=token, max_retries=0,
                                    timeout=120)


async def test_message_equals_the_same_chat_and_streams_the_same(stack) -> None:
    url, model, key, client = stack
    reply = await sdk(url, key.secret).messages.create(
        model=model, system=SYSTEM, messages=ASK, max_tokens=24, extra_body=GREEDY)
    assert reply.type == "message" and reply.role == "assistant"
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.usage.output_tokens <= 24
    (block,) = reply.content
    chat = await openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key.secret).chat.completions\
        .create(model=model, temperature=0.0, max_tokens=24,
                messages=[{"role": "system", "content": SYSTEM}, *ASK])
    assert block.text == chat.choices[0].message.content and "Paris" in block.text
    assert (reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0)
            == chat.usage.prompt_tokens)

    async with sdk(url, token=key.secret).messages.stream(  # Bearer, the same key
            model=model, system=SYSTEM, messages=ASK, max_tokens=24,
            extra_body=GREEDY) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert final.content[0].text == block.text
    assert final.stop_reason == reply.stop_reason
    assert final.usage.output_tokens == reply.usage.output_tokens
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-1] == "message_stop"
    assert kinds[-3:-1] == ["content_block_stop", "message_delta"]
    assert await spent(client, key.id, 3) > 0  # the key's usage holds all three


async def test_stop_sequence_and_count_tokens(stack) -> None:
    url, model, key, client = stack
    api = sdk(url, key.secret)
    whole = await api.messages.create(model=model, system=SYSTEM, messages=ASK, max_tokens=24,
                                      extra_body=GREEDY)
    text = whole.content[0].text
    stop = text.split()[2]  # a word the greedy answer reaches
    cut = await api.messages.create(model=model, system=SYSTEM, messages=ASK, max_tokens=24,
                                    extra_body=GREEDY, stop_sequences=[stop])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == text[:text.index(stop)]
    counted = await api.messages.count_tokens(model=model, system=SYSTEM, messages=ASK)
    assert counted.input_tokens == whole.usage.input_tokens + (
        whole.usage.cache_read_input_tokens or 0)


async def test_tool_use_then_tool_result(stack) -> None:
    url, model, key, client = stack
    api = sdk(url, key.secret)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = await api.messages.create(model=model, messages=ask, max_tokens=40,
                                      extra_body=GREEDY, tools=[WEATHER],
                                      tool_choice={"type": "tool", "name": "get_weather"})
    assert reply.stop_reason == "tool_use"
    (use,) = [b for b in reply.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input.get("city"), str)
    async with api.messages.stream(model=model, messages=ask, max_tokens=40,
                                   extra_body=GREEDY, tools=[WEATHER],
                                   tool_choice={"type": "any"}) as stream:
        streamed = await stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [b.name for b in streamed.content if b.type == "tool_use"] == ["get_weather"]
    answer = await api.messages.create(
        model=model, max_tokens=24, extra_body=GREEDY, tools=[WEATHER],
        tool_choice={"type": "none"},
        messages=[*ask, {"role": "assistant", "content": reply.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "Sunny, 24 degrees"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].text


async def test_errors_are_anthropic_shaped(stack) -> None:
    url, model, key, client = stack
    with pytest.raises(anthropic.BadRequestError) as bad:
        await sdk(url, key.secret).messages.create(model=model, messages=ASK, max_tokens=8,
                                                   extra_body={"temperature": 1.5})
    assert bad.value.status_code == 400
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        await sdk(url, key.secret).messages.create(model="no-such-model", messages=ASK,
                                                   max_tokens=8)
    assert missing.value.body["type"] == "error"
    with pytest.raises(anthropic.AuthenticationError) as refused:
        await sdk(url, "sk-shoal-not-a-key").messages.create(model=model, messages=ASK,
                                                             max_tokens=8)
    assert refused.value.body["error"]["type"] == "authentication_error"
    async with aiohttp.ClientSession() as http:  # max_tokens is required, as Anthropic's is
        async with http.post(f"{url}/v1/messages", headers={"x-api-key": key.secret},
                             json={"model": model, "messages": ASK}) as r:
            body, status = await r.json(), r.status
        async with http.post(f"{url}/v1/messages", json={"model": model, "messages": ASK,
                                                          "max_tokens": 8}) as r:
            missing_key = await r.json()  # no key on a gateway that requires one
    assert status == 400 and body["type"] == "error" and r.status == 401
    assert body["error"]["type"] == "invalid_request_error" and "max_tokens" in str(body)
    assert missing_key["error"]["type"] == "authentication_error"
    assert "x-api-key" in missing_key["error"]["message"]


async def test_metrics_count_requests_by_api(stack) -> None:
    url, model, key, client = stack
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/metrics") as r:
            text = await r.text()
    (line,) = [line for line in text.splitlines() if line.startswith(
        "shoal:gateway_api_requests_total{") and 'api="/v1/messages"' in line
               and f'model_name="{model}"' in line]
    assert float(line.rsplit(" ", 1)[1]) >= 5  # the answered requests of the tests above
    assert f'e2e_request_latency_seconds_count{{model_name="{model}"}}' in text


async def test_messages_have_a_genai_span(stack, gateway_traces) -> None:  # noqa: F811
    """A message's GenAI span ("chat MODEL": Anthropic's Messages is a chat) under the HTTP span
    the client's traceparent parents, with the request's settings and the answer's usage."""
    url, model, key, _ = stack
    received, processor = gateway_traces
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/messages", headers={
                "x-api-key": key.secret, "traceparent": f"00-{trace_id}-{client_span}-01"},
                json={"model": model, "max_tokens": 6, "messages": ASK, **GREEDY}) as r:
            assert r.status == 200, await r.text()
            answer = await r.json()
    processor.force_flush()
    spans = {s.name: s for s in await asyncio.to_thread(
        received.wait_for, trace_id, {"POST /v1/messages", f"chat {model}"})}
    outer, inner = spans["POST /v1/messages"], spans[f"chat {model}"]
    assert outer.parent_span_id == client_span and inner.parent_span_id == outer.span_id
    attrs = inner.attributes
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == model
    assert attrs["gen_ai.request.max_tokens"] == 6 and attrs["gen_ai.request.temperature"] == 0
    # Anthropic's input_tokens leaves out the prefix-cache hits (cache_read_input_tokens, here
    # the earlier tests' shared prompt); the GenAI span counts the whole prompt, as OTel asks.
    usage = answer["usage"]
    prompt = usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0)
    assert attrs["gen_ai.usage.input_tokens"] == prompt
    assert attrs["gen_ai.usage.output_tokens"] == answer["usage"]["output_tokens"] > 0
