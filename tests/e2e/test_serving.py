"""Serving end to end: registry, scheduler, a real worker running SmolLM2 in an engine process, and
the gateway, driven with the official `openai` SDK (sync and async, streamed and not): answers,
greedy parity with the offline `shoal.LLM`, n, stop strings, logprobs, usage and cached tokens,
refusals, client disconnects freeing the engine, the bounded queue, and a killed engine; one
trace from the client's traceparent through gateway and engine, at real OTLP receivers."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import time
import uuid

import aiohttp
import openai
import psutil
import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from shoal.services.engine.model_prep import prepare_model, smollm2_gguf_path
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.schemas.registry import (
    ApiKeyCreate, ApiKeyScope, InstanceFilter, InstancePublic, ModelCreate, UsageQuery
)
from shoal.shared.errors import Timeout, Unavailable
from shoal.shared.states import InstanceState
from tests.integration.conftest import make_settings, running_services
from shoal.shared.embedded import free_port
from tests.integration.test_gateway import running_gateway
from tests.otlp_receiver import GrpcReceiver, HttpReceiver, Switchable
from tests.unit.test_dashboards import declared_series, queried_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
READY_TIMEOUT = 300
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}
ENGINE_ARGS = {"max_num_seqs": 8, "kv_cache_memory": 64 * 2**20, "speculative_config": SPEC}
"""The served engine speculates (n-gram), so every test here also checks that speculation keeps
answers, n, stop strings, logprobs and usage right; the offline LLM compared with does not."""


async def running_instance(client: RegistryClient, model_id: str, timeout: float = READY_TIMEOUT,
                           after_version: int = -1) -> InstancePublic:
    """The model's first RUNNING instance (RUNNING again after `after_version`: restarted). A
    registry slow to answer one poll (two cores, a backend compiling beside it) is asked again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            running = await client.list_instances(InstanceFilter(
                model_id=model_id, state=InstanceState.RUNNING))
        except (Timeout, Unavailable):
            running = []
        running = [i for i in running if i.version > after_version]
        if running:
            return running[0]
        await asyncio.sleep(0.5)
    instances = await client.list_instances(InstanceFilter(model_id=model_id))
    raise AssertionError(f"no RUNNING instance after {timeout}s: {instances}")


@pytest.fixture(scope="module")
def engine_traces():
    """Engines started in this module export their spans over OTLP/gRPC to a real receiver
    (the worker passes its environment on to the engine processes it starts)."""
    receiver = GrpcReceiver()
    env = {"SHOAL_OTEL_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint(),
           "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_BSP_SCHEDULE_DELAY": "200"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield receiver.received
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        receiver.stop()


@pytest.fixture(scope="module")
def gateway_traces():
    """This process's spans (the gateway runs in it) go over OTLP/HTTP to a real receiver."""
    receiver = HttpReceiver()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider(resource=Resource.create({"service.name": "shoal-gateway"}))
        trace.set_tracer_provider(provider)
    processor = Switchable(BatchSpanProcessor(HttpSpanExporter(endpoint=receiver.endpoint())))
    provider.add_span_processor(processor)
    try:
        yield receiver.received, processor
    finally:
        processor.close()
        receiver.stop()


@pytest.fixture(scope="module")
async def stack(servers, tmp_path_factory, engine_traces):
    # heartbeat_timeout 10 s, not the integration tests' 2 s: a test here loads an offline LLM
    # in this process, which can starve the worker's heartbeats for seconds on a loaded machine
    settings = make_settings(servers, tmp_path_factory.mktemp("serving-e2e"), drain_timeout=5.0,
                             heartbeat_timeout=10.0,
                             engine_restart_max_backoff=2.0, gateway_engine_dead_after=2.0,
                             gateway_port=free_port(None), scheduler_interval=1.0)
    async with running_services(settings, worker={"worker_name": f"real-{uuid.uuid4().hex[:6]}"},
                                gateway={}, name="serving-e2e") as stack:
        client = stack.client
        model = await client.create_model(ModelCreate(
            name=f"smol-{uuid.uuid4().hex[:6]}", source=str(smollm2_gguf_path()), device="cpu",
            max_model_len=512, engine_args=ENGINE_ARGS, worker_selector=stack.selector))
        inst = await running_instance(client, model.id)
        yield settings, client, model, inst, stack.url


@pytest.fixture(scope="module")
async def offline(stack):
    """The offline engine on the same model without speculation (loaded once: a load in this
    process can starve the services' heartbeats on a loaded machine)."""
    from shoal import LLM

    settings = stack[0]
    folder = await asyncio.to_thread(prepare_model, str(smollm2_gguf_path()),
                                     settings.model_cache_dir)
    plain = {k: v for k, v in ENGINE_ARGS.items() if k != "speculative_config"}
    return await asyncio.to_thread(LLM, str(folder), max_model_len=512, **plain)


def async_api(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def sync_api(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


async def scrape_all(url: str) -> dict[str, str]:
    """What a Prometheus scraping every target finds: /metrics of each address the gateway's
    /metrics/targets lists (gateways, registry, scheduler, worker, engines)."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/metrics/targets") as r:
            groups = await r.json()
        scraped = {}
        for group in groups:
            (address,) = group["targets"]
            async with http.get(f"http://{address}/metrics") as r:
                scraped[address] = await r.text()
        return scraped


async def metric(url: str, name: str, model: str) -> float:
    """`name` summed over every target, as a PromQL sum() over all of them would."""
    values = [float(line.rsplit(" ", 1)[1]) for text in (await scrape_all(url)).values()
              for line in text.splitlines()
              if line.startswith(name + "{") and f'model_name="{model}"' in line]
    return sum(values)


async def test_chat_sync_and_async_stream_answer_paris(stack) -> None:
    settings, client, model, inst, url = stack
    reply = await asyncio.to_thread(lambda: sync_api(url).chat.completions.create(
        model=model.name, messages=FRANCE, temperature=0, max_tokens=20))
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.prompt_tokens > 0 and 0 < reply.usage.completion_tokens <= 20
    assert reply.choices[0].finish_reason in ("stop", "length")
    stream = await async_api(url).chat.completions.create(
        model=model.name, messages=FRANCE, temperature=0, max_tokens=20, stream=True,
        stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    # the first chunk with choices carries the first token (and the role): no early role-only
    # chunk that a benchmark client would time as the first token (vLLM's behaviour)
    first = next(c for c in chunks if c.choices)
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.role) == 1
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    reasons = [c.choices[0].finish_reason for c in chunks
               if c.choices and c.choices[0].finish_reason]
    assert reasons == [reply.choices[0].finish_reason]


async def test_one_trace_from_the_client_through_gateway_and_engine(stack, gateway_traces,
                                                                   engine_traces) -> None:
    """The client's traceparent parents the gateway's HTTP span (OTLP/HTTP receiver), whose
    GenAI span parents the engine's (OTLP/gRPC receiver, another process), whose children are
    the request's queue, prefill and decode phases."""
    settings, client, model, inst, url = stack
    received, processor = gateway_traces
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    reply = await async_api(url).chat.completions.create(
        model=model.name, messages=FRANCE, temperature=0, max_tokens=8,
        extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
    processor.force_flush()
    chat_name, engine_name = f"chat {model.name}", f"generate {model.name}"
    spans = {s.name: s for s in await asyncio.to_thread(
        received.wait_for, trace_id, {"POST /v1/chat/completions", chat_name})}
    http, chat = spans["POST /v1/chat/completions"], spans[chat_name]
    assert http.parent_span_id == client_span and http.kind == 2  # SERVER
    assert 200 in (http.attributes.get("http.status_code"),
                   http.attributes.get("http.response.status_code"))
    assert chat.parent_span_id == http.span_id
    assert chat.attributes["gen_ai.operation.name"] == "chat"
    assert chat.attributes["gen_ai.request.model"] == model.name
    assert chat.attributes["gen_ai.request.max_tokens"] == 8
    assert chat.attributes["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens
    assert chat.attributes["gen_ai.usage.output_tokens"] == reply.usage.completion_tokens
    assert chat.attributes["gen_ai.response.finish_reasons"] == [reply.choices[0].finish_reason]
    assert chat.attributes["gen_ai.response.id"] == reply.id

    engine = {s.name: s for s in await asyncio.to_thread(
        engine_traces.wait_for, trace_id, {engine_name, "queue", "prefill", "decode"})}
    generate = engine[engine_name]
    assert generate.service == "shoal-engine" and generate.parent_span_id == chat.span_id
    assert generate.attributes["gen_ai.usage.output_tokens"] == reply.usage.completion_tokens
    assert generate.attributes["messaging.system"] == "nats"
    queue, prefill, decode = engine["queue"], engine["prefill"], engine["decode"]
    assert {queue.parent_span_id, prefill.parent_span_id, decode.parent_span_id} == \
        {generate.span_id}
    assert queue.start_ns <= queue.end_ns <= prefill.start_ns + 1000 and \
        prefill.end_ns <= decode.start_ns + 1000 and decode.end_ns <= generate.end_ns


async def test_continuous_usage_stats_count_every_chunk(stack) -> None:
    """vLLM's stream_options.continuous_usage_stats: each chunk carries the usage so far, its
    completion tokens growing to the final count; without it the chunks carry usage null."""
    settings, client, model, inst, url = stack
    for continuous in (True, False):
        stream = await async_api(url).completions.create(
            model=model.name, prompt="Count: one, two, three,", temperature=0, max_tokens=12,
            stream=True, stream_options={"include_usage": True,
                                         "continuous_usage_stats": continuous})
        chunks = [c async for c in stream]
        final = chunks[-1].usage
        assert not chunks[-1].choices and final is not None and final.completion_tokens == 12
        middle = [c.usage for c in chunks[:-1]]
        if not continuous:
            assert middle and all(u is None for u in middle)
            continue
        assert all(u is not None and u.prompt_tokens == final.prompt_tokens for u in middle)
        counts = [u.completion_tokens for u in middle]
        assert counts == sorted(counts) and counts[-1] == 12
        assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in middle)


async def test_greedy_completion_equals_offline_llm(stack, offline) -> None:
    settings, client, model, inst, url = stack
    from shoal.services.engine.sampling_params import SamplingParams

    prompt = "The capital of France is"
    served = await async_api(url).completions.create(model=model.name, prompt=prompt, temperature=0,
                                                     max_tokens=16)
    llm = offline
    offline = await asyncio.to_thread(llm.generate, [prompt],
                                      SamplingParams(temperature=0, max_tokens=16), False)
    assert served.choices[0].text == offline[0].outputs[0].text
    streamed = await async_api(url).completions.create(model=model.name, prompt=prompt,
                                                       temperature=0,
                                                       max_tokens=16, stream=True)
    assert "".join([c.choices[0].text async for c in streamed]) == served.choices[0].text


async def test_speculation_served_with_vllms_metrics(stack, offline) -> None:
    """A copy-heavy chat through the openai SDK: greedy answer equal to the offline engine's
    without speculation, and the engine's /metrics counts drafts and accepted tokens."""
    settings, client, model, inst, url = stack
    from shoal.services.engine.sampling_params import SamplingParams

    text = ("Shoal serves language models: a gateway, a registry, a scheduler, workers and "
            "engines talk over NATS and keep their state in Postgres.")
    messages = [{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}]
    before = await metric(url, "vllm:spec_decode_num_draft_tokens_total", model.name)
    served = await async_api(url).chat.completions.create(model=model.name, messages=messages,
                                                          temperature=0, max_tokens=40)
    plain = await asyncio.to_thread(offline.chat, messages,
                                    SamplingParams(temperature=0, max_tokens=40), False)
    assert served.choices[0].message.content == plain[0].outputs[0].text
    drafts = await metric(url, "vllm:spec_decode_num_draft_tokens_total", model.name)
    accepted = await metric(url, "vllm:spec_decode_num_accepted_tokens_total", model.name)
    assert drafts > before and accepted > 0
    assert await metric(url, "vllm:spec_decode_num_drafts_total", model.name) > 0
    per_pos = await metric(url, "vllm:spec_decode_num_accepted_tokens_per_pos_total", model.name)
    assert per_pos == accepted


async def test_n_stop_and_logprobs(stack) -> None:
    settings, client, model, inst, url = stack
    api = async_api(url)
    two = await api.chat.completions.create(model=model.name, messages=FRANCE, n=2, seed=7,
                                            temperature=0.8, max_tokens=12)
    assert sorted(c.index for c in two.choices) == [0, 1]
    full = await api.completions.create(model=model.name, prompt="One, two, three,", temperature=0,
                                        max_tokens=12)
    words = full.choices[0].text.split()
    assert len(words) >= 2
    stop = words[1]
    cut = await api.completions.create(model=model.name, prompt="One, two, three,", temperature=0,
                                       max_tokens=12, stop=[stop])
    assert cut.choices[0].text == full.choices[0].text[:full.choices[0].text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    lp = await api.chat.completions.create(model=model.name, messages=FRANCE, temperature=0,
                                           max_tokens=8,
                                           logprobs=True, top_logprobs=3)
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 3 for t in content)
    # the EOS token has a logprob too, though its text is not in the content
    assert "".join(t.token for t in content).startswith(lp.choices[0].message.content)
    comp = await api.completions.create(model=model.name, prompt="Hello", temperature=0,
                                        max_tokens=5, logprobs=2)
    assert len(comp.choices[0].logprobs.tokens) == comp.usage.completion_tokens
    batch = await api.completions.create(model=model.name, prompt=["Hello", "The sky is"], n=2,
                                         temperature=0,
                                         max_tokens=3, echo=True)
    assert [c.index for c in sorted(batch.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    assert all(c.text.startswith("Hello" if c.index < 2 else "The sky is") for c in batch.choices)
    assert batch.usage.completion_tokens == 12
    assert (await api.models.retrieve(model.name)).id == model.name


async def test_logit_bias_through_the_sdk(stack) -> None:
    """logit_bias reaches the (speculating) engine's sampler: +100 on one token makes every
    output token that one, greedy or sampled, for every choice of n; an id past the vocabulary
    is a 400 naming logit_bias."""
    settings, client, model, inst, url = stack
    api = async_api(url)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/tokenize", json={"model": model.name, "prompt": " blue"}) as r:
            blue = (await r.json())["tokens"][-1]
    plain = await api.chat.completions.create(model=model.name, messages=FRANCE, temperature=0,
                                              max_tokens=5)
    assert "blue" not in plain.choices[0].message.content
    for extra in ({"temperature": 0}, {"temperature": 1.0, "n": 2, "seed": 3}):
        forced = await api.chat.completions.create(
            model=model.name, messages=FRANCE, max_tokens=5, logit_bias={str(blue): 100},
            **extra)
        assert len(forced.choices) == extra.get("n", 1)
        for choice in forced.choices:
            assert choice.message.content.replace(" ", "") == "blue" * 5, choice.message.content
    with pytest.raises(openai.BadRequestError) as refused:
        await api.chat.completions.create(model=model.name, messages=FRANCE, max_tokens=2,
                                          logit_bias={"10000000": 5})
    assert refused.value.body["param"] == "logit_bias"


async def test_cached_tokens_tokenize_and_refusals(stack) -> None:
    settings, client, model, inst, url = stack
    api = async_api(url)
    long_prompt = "Here is a long shared preamble about the history of Paris. " * 20
    await api.completions.create(model=model.name, prompt=long_prompt, temperature=0, max_tokens=2)
    again = await api.completions.create(model=model.name, prompt=long_prompt, temperature=0,
                                         max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    with pytest.raises(openai.BadRequestError):
        await api.completions.create(model=model.name, prompt="hello " * 600, max_tokens=10)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/tokenize",
                             json={"model": model.name, "prompt": "Hello world"}) as r:
            tok = await r.json()
        assert r.status == 200 and tok["max_model_len"] == 512
        assert tok["count"] == len(tok["tokens"]) > 0
        async with http.post(f"{url}/detokenize",
                             json={"model": model.name, "tokens": tok["tokens"]}) as r:
            assert "Hello world" in (await r.json())["prompt"]
        async with http.post(f"{url}/v1/rerank", json={"model": model.name, "query": "q",
                                                        "documents": ["a", "b"]}) as r:
            err = (await r.json())["error"]  # a generation model does not rerank
        assert r.status == 400 and err["code"] == "wrong_model_type"
        assert model.name in err["message"] and "cross-encoder" in err["message"]
    assert await metric(url, "vllm:e2e_request_latency_seconds_count", model.name) > 0
    assert await metric(url, "vllm:prefix_cache_hits_total", model.name) > 0


async def test_dashboards_queries_resolve_and_sums_count_once(stack) -> None:
    """Every metric the shipped dashboards query is on some target of the live stack; a request
    through a second gateway is counted once in the sum over all targets."""
    settings, client, model, inst, url = stack
    api = async_api(url)
    await api.chat.completions.create(model=model.name, messages=FRANCE, max_tokens=4, n=2)
    scraped = await scrape_all(url)
    assert {_service_of(text) for text in scraped.values()} >= {
        "gateway", "registry", "scheduler", "worker", "engine"}
    lines = [line for text in scraped.values() for line in text.splitlines()]
    declared = set().union(*(declared_series(text) for text in scraped.values()))
    missing = sorted(queried_metrics() - declared)
    assert not missing, f"dashboard queries naming metrics no target exposes: {missing}"
    # vLLM's dashboard has data to draw after one request (on a CPU stack with nothing
    # pending, the GPU and pending-placement families are declared without series)
    series = {line.split("{")[0].split(" ")[0] for line in lines if not line.startswith("#")}
    vllm = sorted(m for m in queried_metrics() if m.startswith("vllm:") and m not in series)
    assert not vllm, f"vLLM dashboard metrics without data: {vllm}"

    names = ("vllm:e2e_request_latency_seconds_count", "vllm:request_success_total",
             "vllm:request_prefill_time_seconds_count")
    before = [await metric(url, n, model.name) for n in names]
    async with running_gateway(settings) as second:
        await async_api(second).completions.create(model=model.name, prompt="Hi", max_tokens=2)
        after = [await metric(url, n, model.name) for n in names]
    assert [a - b for a, b in zip(after, before)] == [1, 1, 1]


def _service_of(text: str) -> str:
    """Which process a scrape came from, by a metric only that kind of process has."""
    for service, marker in (("engine", "vllm:cache_config_info"),
                            ("gateway", "shoal:gateway_requests_in_flight"),
                            ("scheduler", "shoal:scheduler_is_leader"),
                            ("worker", "shoal:worker_cpu_cores"),
                            ("registry", "shoal:bus_request_duration_seconds")):
        if marker in text:
            return service
    return ""


async def test_a_key_on_an_open_stack_is_counted_and_bad_numbers_are_400(stack) -> None:
    """Issue 24: without SHOAL_REQUIRE_API_KEY a key's usage was never recorded (the key did
    nothing); and `repetition_penalty: 1e309` was a 503 "malformed reply from the engine" with
    Retry-After, which SDKs retry. The key is counted; the number is a 400 naming it."""
    settings, client, model, inst, url = stack
    key = await client.create_key(ApiKeyCreate(name=f"open-{uuid.uuid4().hex[:6]}",
                                               scope=ApiKeyScope.INFERENCE))
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key.secret, max_retries=0,
                             timeout=120)
    reply = await api.chat.completions.create(model=model.name, messages=FRANCE, max_tokens=4)
    rows = []
    for _ in range(100):  # keys without limits have their usage sent every second
        rows = (await client.usage(UsageQuery(key_id=key.id))).rows
        if rows:
            break
        await asyncio.sleep(0.1)
    assert [(r.requests, r.output_tokens) for r in rows] == [(1, reply.usage.completion_tokens)]
    chat = {"model": model.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    body = json.dumps(chat)[:-1] + ', "repetition_penalty": 1e309}'  # json.dumps cannot write it
    async with aiohttp.ClientSession() as http, http.post(
            f"{url}/v1/chat/completions", data=body,
            headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400 and "Retry-After" not in r.headers, await r.text()
        assert (await r.json())["error"]["param"] == "repetition_penalty"


async def test_client_disconnect_frees_the_engine(stack) -> None:
    settings, client, model, inst, url = stack
    body = {"model": model.name, "prompt": "Count to one thousand:", "max_tokens": 400,
            "ignore_eos": True,
            "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200
            for _ in range(4):
                await r.content.readline()
            assert await metric(url, "vllm:num_requests_running", model.name) >= 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        if (await metric(url, "vllm:num_requests_running", model.name) == 0
                and await metric(url, "vllm:kv_cache_usage_perc", model.name) == 0.0):
            break
    assert await metric(url, "vllm:num_requests_running", model.name) == 0
    assert await metric(url, "vllm:kv_cache_usage_perc", model.name) == 0.0


async def test_bounded_queue_refuses_beyond_its_limit(stack) -> None:
    settings, client, model, inst, url = stack
    async with running_gateway(settings.model_copy(update={"gateway_max_outstanding": 1})) as small:
        api = async_api(small)
        held = asyncio.create_task(api.completions.create(
            model=model.name, prompt="Count:", max_tokens=60, extra_body={"ignore_eos": True}))
        await asyncio.sleep(0.5)
        with pytest.raises(openai.RateLimitError):
            await api.completions.create(model=model.name, prompt="hi", max_tokens=2)
        assert (await held).usage.completion_tokens == 60


def engine_pids(instance_id: str) -> list[int]:
    cmdlines = {p.pid: " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])}
    return [pid for pid, cmd in cmdlines.items() if instance_id in cmd and "engine" in cmd]


async def test_killed_engine_ends_the_stream_with_an_error_then_comes_back(stack) -> None:
    settings, client, model, inst, url = stack
    api = async_api(url)
    before = await client.get_instance(inst.id)
    stream = await api.completions.create(model=model.name, prompt="Count to one thousand:",
                                          max_tokens=400,
                                          temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
    pids = engine_pids(inst.id)
    assert len(pids) == 1
    received = 0
    started = time.monotonic()
    with pytest.raises(openai.APIError):
        async for _ in stream:
            received += 1
            if received == 3:
                os.kill(pids[0], signal.SIGKILL)
    assert time.monotonic() - started < 30
    await running_instance(client, model.id, after_version=before.version)
    # RUNNING in the registry: the gateway routes to the new engine at once, no 503 in between
    again = await api.chat.completions.create(model=model.name, messages=FRANCE,
                                              temperature=0, max_tokens=20)
    assert "Paris" in again.choices[0].message.content
