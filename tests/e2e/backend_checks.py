"""The openai-SDK checks every backend passes through the gateway (test_backend_custom.py,
test_backend_vllm.py): chat and completions, streamed and not, usage with cached tokens,
/v1/models, logprobs, structured outputs and tool calls (named, and "auto" read by the parser the
deploy names as vLLM users do: TOOL_FLAGS), an aborted stream freeing the backend, a key's
token budget, the backend's /metrics among the targets with the instance's labels, and a
SIGKILLed backend process (the stream ends with an error, the instance comes back)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import json

import aiohttp
import openai
import psutil

from shoal.services.engine import prepare_model, smollm2_gguf_path
from shoal.shared.bus.client import Bus
from shoal.shared.embedded import free_port
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.schemas.infer import EngineLoad
from shoal.shared.schemas.registry import (
    ApiKeyCreate, ApiKeyScope, InstancePublic, KeyLimit, ModelPublic
)
from shoal.shared.schemas.registry import ModelCreate
from tests.e2e.test_serving import FRANCE, running_instance
from tests.e2e.test_structured_serving import ASK, PERSON, TOOLS, check_arguments
from tests.integration.conftest import make_settings, running_services


TOOL_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser hermes"]
"""vLLM's flags for tool_choice "auto", given as its users give them: the adapter reads the parser
from them (the gateway parses every backend's tool calls)."""


@dataclass
class Served:
    client: RegistryClient
    bus: Bus
    model: ModelPublic
    instance: InstancePublic
    url: str
    selector: dict[str, str]
    """Selects the stack's worker (for a further model on it)."""


@contextlib.asynccontextmanager
async def serving(servers: Any, data_dir: Path, name: str, ready_timeout: float,
                  settings: dict[str, Any] | None = None, **model: Any) -> AsyncIterator[Served]:
    """A stack with a real worker and a gateway, and SmolLM2's Hugging Face folder deployed on
    its CPU with the backend `model` names, RUNNING."""
    config = make_settings(servers, data_dir, drain_timeout=5.0, heartbeat_timeout=10.0,
                           engine_restart_max_backoff=2.0, gateway_engine_dead_after=5.0,
                           gateway_port=free_port(None), scheduler_interval=1.0,
                           **(settings or {}))
    worker = {"worker_name": f"{name}-{uuid.uuid4().hex[:6]}"}
    async with running_services(config, worker=worker, gateway={}, name=name) as stack:
        created = await stack.client.create_model(ModelCreate(
            name=f"{name}-{uuid.uuid4().hex[:6]}",
            source=str(prepare_model(str(smollm2_gguf_path()))), device="cpu",
            max_model_len=1024, worker_selector=stack.selector, **model))
        inst = await running_instance(stack.client, created.id, ready_timeout)
        bus = await Bus.connect(config, name=f"{name}-test")
        try:
            yield Served(stack.client, bus, created, inst, stack.url, stack.selector)
        finally:
            await bus.close()


def api(url: str, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)


async def check_chat_and_completions(s: Served) -> None:
    a = api(s.url)
    chat = await a.chat.completions.create(model=s.model.name, messages=FRANCE, temperature=0,
                                           max_tokens=24)
    assert "Paris" in chat.choices[0].message.content
    assert chat.model == s.model.name and chat.usage.prompt_tokens > 10
    assert 0 < chat.usage.completion_tokens <= 24
    done = await a.completions.create(model=s.model.name, prompt="One, two, three,",
                                      max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert done.choices[0].text and done.usage.completion_tokens == 8
    assert done.choices[0].finish_reason == "length"
    models = await a.models.list()
    assert s.model.name in [m.id for m in models.data]


async def check_streaming_usage_and_cache(s: Served) -> None:
    a = api(s.url)
    long = [{"role": "system", "content": "You answer briefly. " * 40}, *FRANCE]
    for _ in range(2):  # the second reads the first's prefix from the cache
        stream = await a.chat.completions.create(
            model=s.model.name, messages=long, temperature=0, max_tokens=12, stream=True,
            stream_options={"include_usage": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage
        assert text and usage is not None and usage.completion_tokens > 0
        assert usage.prompt_tokens > 100
    assert usage.prompt_tokens_details.cached_tokens > 0, usage


async def check_abort_frees_the_backend(s: Served) -> None:
    """A client that goes away mid-stream: the backend stops generating (its load says nothing
    runs), rather than finishing 900 tokens for nobody."""
    a = api(s.url)
    stream = await a.completions.create(model=s.model.name, prompt="Count to one thousand:",
                                        max_tokens=900, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
    received = 0
    async for _ in stream:
        received += 1
        if received == 3:
            break
    await stream.close()
    loads: asyncio.Queue[EngineLoad] = asyncio.Queue()

    async def on_load(msg) -> None:  # noqa: ANN001
        await loads.put(EngineLoad.model_validate_json(msg.data))

    sub = await s.bus.nc.subscribe(s.bus.subjects.load(s.instance.id), cb=on_load)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            load = await asyncio.wait_for(loads.get(), 30)
            if load.num_running == 0 and load.num_waiting == 0:
                break
        else:
            raise AssertionError(f"the aborted request still runs: {load}")
    finally:
        await sub.unsubscribe()


async def check_logprobs(s: Served) -> None:
    """Chat's logprobs with top_logprobs 2 and completions' logprobs 1, greedy: one entry per
    token, the asked number of alternatives, best first, the chosen one the best."""
    a = api(s.url)
    chat = await a.chat.completions.create(model=s.model.name, messages=FRANCE, temperature=0,
                                           max_tokens=6, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob <= 0
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.top_logprobs[0].token == item.token
        assert abs(item.top_logprobs[0].logprob - item.logprob) < 1e-3
    done = await a.completions.create(model=s.model.name, prompt="One, two, three,",
                                      max_tokens=4, temperature=0, logprobs=1)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == done.choices[0].text
    assert all(len(top) == 1 and list(top.values())[0] <= 0 for top in lp.top_logprobs)


async def check_structured_and_named_tool(s: Served) -> None:
    """response_format json_schema, and a named tool choice answered as a tool call."""
    a = api(s.url)
    reply = await a.chat.completions.create(
        model=s.model.name, temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "Invent a person, as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    person = json.loads(reply.choices[0].message.content)
    assert set(person) <= {"name", "age"} and isinstance(person["name"], str)
    assert isinstance(person["age"], int) and person["age"] >= 0
    named = await a.chat.completions.create(
        model=s.model.name, messages=ASK, temperature=0, max_tokens=60, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    check_arguments(call.function.name, call.function.arguments)


async def check_auto_tool_choice(s: Served) -> None:
    """tool_choice "auto" read with the hermes parser the deploy named in backend_parameters.
    SmolLM2 was not trained for tools: guided_choice makes it answer in hermes' format (the
    parser is under test; streamed tool call deltas are the gateway's, tested on our engine)."""
    a = api(s.url)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": ' \
           '"celsius"}}\n</tool_call>'
    args = dict(model=s.model.name, messages=ASK, temperature=0, max_tokens=150, tools=TOOLS,
                extra_body={"guided_choice": [call]})
    reply = (await a.chat.completions.create(**args)).choices[0]
    assert reply.finish_reason == "tool_calls" and not reply.message.content
    [tool_call] = reply.message.tool_calls
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Paris", "unit": "celsius"}


async def check_key_token_budget(s: Served) -> None:
    key = await s.client.create_key(ApiKeyCreate(
        name=f"budget-{uuid.uuid4().hex[:6]}", scope=ApiKeyScope.INFERENCE,
        limits=[KeyLimit(model=s.model.name, token_budget=60)]))
    a = api(s.url, key.secret)
    refused = None
    for _ in range(20):  # usage is recorded after each answer; the budget then runs out
        try:
            await a.chat.completions.create(model=s.model.name, messages=FRANCE,
                                            temperature=0, max_tokens=16)
        except openai.RateLimitError as exc:
            refused = exc
            break
        await asyncio.sleep(0.5)
    assert refused is not None and "insufficient_quota" in str(refused.body)


async def check_metrics_target(s: Served, series: str) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{s.url}/metrics/targets") as r:
            groups = await r.json()
        mine = [g for g in groups if g["labels"].get("shoal_service") == "backend"
                and g["labels"].get("instance") == s.instance.name]
        assert mine, groups
        assert mine[0]["labels"]["model_name"] == s.model.name
        async with http.get(f"http://{mine[0]['targets'][0]}/metrics") as r:
            assert r.status == 200 and series in await r.text()


def backend_pids(instance_id: str) -> list[int]:
    """The backend process: the child of the instance's adapter (`shoal engine ... ID`)."""
    adapters = [p for p in psutil.process_iter(["cmdline"])
                if instance_id in " ".join(p.info["cmdline"] or [])
                and "engine" in (p.info["cmdline"] or [])]
    return [c.pid for a in adapters for c in a.children()]


async def check_sigkill_then_back(s: Served, timeout: float) -> None:
    a = api(s.url)
    before = await s.client.get_instance(s.instance.id)
    pids = backend_pids(s.instance.id)
    assert len(pids) == 1, pids
    stream = await a.completions.create(model=s.model.name, prompt="Count to one thousand:",
                                        max_tokens=1000, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
    received = 0
    try:
        async for _ in stream:
            received += 1
            if received == 3:
                os.kill(pids[0], signal.SIGKILL)
    except openai.APIError:
        pass
    else:
        raise AssertionError("the stream ended without an error")
    back = await running_instance(s.client, s.model.id, timeout, after_version=before.version)
    assert back.restart_count > before.restart_count
    chat = await a.chat.completions.create(model=s.model.name, messages=FRANCE, temperature=0,
                                           max_tokens=24)
    assert "Paris" in chat.choices[0].message.content


class BackendChecks:
    """The checks as tests, for a module that gives a `served` fixture and READY_TIMEOUT."""

    metrics_series = ""
    ready_timeout = 600.0

    async def test_chat_and_completions(self, served: Served) -> None:
        await check_chat_and_completions(served)

    async def test_streaming_usage_and_cached_tokens(self, served: Served) -> None:
        await check_streaming_usage_and_cache(served)

    async def test_abort_frees_the_backend(self, served: Served) -> None:
        await check_abort_frees_the_backend(served)

    async def test_logprobs(self, served: Served) -> None:
        await check_logprobs(served)

    async def test_structured_output_and_named_tool(self, served: Served) -> None:
        await check_structured_and_named_tool(served)

    async def test_auto_tool_choice_with_the_deploys_parser(self, served: Served) -> None:
        await check_auto_tool_choice(served)

    async def test_key_token_budget(self, served: Served) -> None:
        await check_key_token_budget(served)

    async def test_backend_metrics_target(self, served: Served) -> None:
        await check_metrics_target(served, self.metrics_series)

    async def test_sigkill_ends_the_stream_then_comes_back(self, served: Served) -> None:
        await check_sigkill_then_back(served, self.ready_timeout)
