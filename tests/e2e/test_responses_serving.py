"""OpenAI's Responses API through a real `shoal up` stack serving SmolLM2, driven with the openai
SDK's `client.responses`: a three-turn conversation by previous_response_id answers exactly as
the same turns sent whole to /v1/chat/completions (greedy), streamed and not; it goes on after
the gateway and the registry are SIGKILLed (stored in Postgres, not in a process); GET and
DELETE; a stored response is seen only with the key that created it; function calls; the
request's GenAI span, exported by the stack's gateway over OTLP to a real receiver."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time

import aiohttp
import openai
import pytest

from shoal.shared.embedded import free_port
from tests.e2e.stack_waits import wait_model_served
from tests.e2e.test_chaos import _service_pid
from tests.otlp_receiver import GrpcReceiver

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MODEL = "SmolLM2-135M-Instruct"
TURNS = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?"]
GREEDY = {"temperature": 0, "max_output_tokens": 16}


@pytest.fixture(scope="module")
def traces():
    """Where the stack's processes export their spans (OTLP/gRPC)."""
    receiver = GrpcReceiver()
    try:
        yield receiver
    finally:
        receiver.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, traces: GrpcReceiver):
    tmp = tmp_path_factory.mktemp("responses-e2e")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "OTEL_"))}
    env.update(SHOAL_DATA_DIR=str(tmp / "stack"), SHOAL_GATEWAY_PORT=str(port),
               SHOAL_HEARTBEAT_INTERVAL="1", SHOAL_GATEWAY_ENGINE_DEAD_AFTER="10",
               SHOAL_OTEL_EXPORTER="otlp", OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=traces.endpoint(),
               OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="grpc", OTEL_BSP_SCHEDULE_DELAY="200")
    with (tmp / "up.log").open("w") as out:
        up = subprocess.Popen([sys.executable, "-m", "shoal", "up"], env=env, stdout=out,
                              stderr=subprocess.STDOUT, text=True)
    try:
        yield up, f"http://127.0.0.1:{port}", tmp / "up.log"
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()


@pytest.fixture(scope="module")
async def base(stack) -> str:
    up, url, log = stack
    async with aiohttp.ClientSession() as http:
        await wait_model_served(http, url, MODEL, 300, alive=lambda: up.poll() is None,
                                context=lambda: log.read_text()[-3000:])
    return url


def api(base: str, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)


async def whole_chat(base: str, answers: list[str]) -> str:
    """The third turn sent whole to chat, the first two answers as the assistant's turns."""
    messages = []
    for question, answer in zip(TURNS, [*answers, None]):
        messages.append({"role": "user", "content": question})
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
    chat = await api(base).chat.completions.create(model=MODEL, messages=messages,
                                                   temperature=0, max_tokens=16)
    return chat.choices[0].message.content


async def until_served(client: openai.AsyncOpenAI, response_id: str, bound: float) -> float:
    """Seconds until the stored response can be read again (gateway and registry back)."""
    started = time.monotonic()
    while time.monotonic() - started < bound:
        with contextlib.suppress(openai.APIError, aiohttp.ClientError, TimeoutError):
            await client.responses.retrieve(response_id, timeout=10)
            return time.monotonic() - started
        await asyncio.sleep(0.3)
    raise AssertionError(f"not served again within {bound}s")


async def test_three_turns_equal_chat_and_outlive_gateway_and_registry(stack, base) -> None:
    up = stack[0]
    client = api(base)
    first = await client.responses.create(model=MODEL, input=TURNS[0], **GREEDY)
    assert first.status in ("completed", "incomplete") and first.output_text
    async with client.responses.stream(model=MODEL, input=TURNS[1], **GREEDY,
                                       previous_response_id=first.id) as stream:
        kinds = [event.type async for event in stream]
        second = await stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                            "response.incomplete")
    assert (await client.responses.retrieve(second.id)).output_text == second.output_text

    recovery = {}
    for victim in ("gateway", "registry"):
        os.kill(_service_pid(up, victim), signal.SIGKILL)
        await asyncio.sleep(0.5)
        recovery[victim] = await until_served(client, second.id, 60)
    print(f"\n[responses] served again after SIGKILL (s): {recovery}")

    third = await client.responses.create(model=MODEL, input=TURNS[2], **GREEDY,
                                          previous_response_id=second.id)
    assert third.previous_response_id == second.id
    expected = await whole_chat(base, [first.output_text, second.output_text])
    assert third.output_text == expected
    async with aiohttp.ClientSession() as http:  # the restarted gateway counted the third
        async with http.get(f"{base}/metrics") as r:
            text = await r.text()
    assert (f'shoal:gateway_api_requests_total{{api="/v1/responses",model_name="{MODEL}"}} 1.0'
            in text), [line for line in text.splitlines() if "api_requests" in line]


async def test_get_delete_and_keys_scope_stored_responses(base) -> None:
    async with aiohttp.ClientSession() as http:  # an open gateway: any request may make keys
        keys = []
        for name in ("resp-a", "resp-b"):
            async with http.post(f"{base}/api/v1/keys", json={"name": name + str(time.time_ns()),
                                                               "scope": "inference"}) as r:
                assert r.status == 201, await r.text()
                keys.append((await r.json())["secret"])
    owner, other = api(base, keys[0]), api(base, keys[1])
    made = await owner.responses.create(model=MODEL, input="Say hi.", **GREEDY)
    assert (await owner.responses.retrieve(made.id)).id == made.id
    for stranger in (other, api(base)):  # another key, or none, does not see it
        with pytest.raises(openai.NotFoundError):
            await stranger.responses.retrieve(made.id)
        with pytest.raises(openai.NotFoundError):
            await stranger.responses.create(model=MODEL, input="More.", **GREEDY,
                                            previous_response_id=made.id)
    unstored = await owner.responses.create(model=MODEL, input="Hi", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        await owner.responses.retrieve(unstored.id)
    await owner.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        await owner.responses.retrieve(made.id)


async def test_function_call_then_its_output(base) -> None:
    client = api(base)
    tools = [{"type": "function", "name": "get_weather", "description": "Weather now",
              "parameters": {"type": "object", "properties": {
                  "city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}]
    asked = await client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=tools, **GREEDY,
        tool_choice={"type": "function", "name": "get_weather"})
    (call,) = asked.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert isinstance(json.loads(call.arguments)["city"], str)
    answered = await client.responses.create(
        model=MODEL, previous_response_id=asked.id, tools=tools, tool_choice="none", **GREEDY,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "Sunny, 24 degrees"}])
    assert answered.output_text



async def test_a_response_has_a_genai_span(base, traces: GrpcReceiver) -> None:
    """The gateway's GenAI span of a response ("chat MODEL", the chat path's) under the HTTP
    span the client's traceparent parents, with the answer's usage."""
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    out = await api(base).responses.create(
        model=MODEL, input=TURNS[0], store=False, **GREEDY,
        extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
    spans = {s.name: s for s in await asyncio.to_thread(
        traces.received.wait_for, trace_id, {"POST /v1/responses", f"chat {MODEL}"})}
    outer, inner = spans["POST /v1/responses"], spans[f"chat {MODEL}"]
    assert outer.parent_span_id == client_span and inner.parent_span_id == outer.span_id
    attrs = inner.attributes
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == MODEL
    assert attrs["gen_ai.request.max_tokens"] == 16
    assert attrs["gen_ai.usage.input_tokens"] == out.usage.input_tokens
    assert attrs["gen_ai.usage.output_tokens"] == out.usage.output_tokens > 0
