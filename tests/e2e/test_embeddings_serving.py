"""Embeddings end to end: all-MiniLM-L6-v2 deployed through the management API (HTTP), placed by
the scheduler on a real worker whose engine process serves it, and asked through the gateway
with the `openai` SDK (base64, its default, and float; texts and token ids; a list longer than
one bus batch), against sentence-transformers' own vectors; the refusals. A cross-encoder's
/v1/rerank and /v1/score, a decoder embedder (a tiny Qwen3 saved as Qwen3-Embedding is: last-token
pooling), and the GenAI spans and metrics of the three pooling routes."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid

import aiohttp
import numpy as np
import openai
import pytest

from shoal.services.engine.model_prep import minilm_path
from shoal.services.gateway.openai.embeddings import BATCH_INPUTS
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.embedded import free_port
from shoal.shared.schemas.registry import (
    ApiKeyCreate, ApiKeyScope, KeyLimit, UsageQuery
)
from tests.e2e.test_serving import gateway_traces, running_instance  # noqa: F401 - a fixture
from tests.integration.conftest import make_settings, running_services
from tests.integration.test_gateway import running_gateway
from tests.tiny_models import save_tiny_cross_encoder, save_tiny_decoder_embedder

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SentenceTransformer = pytest.importorskip("sentence_transformers").SentenceTransformer
CrossEncoder = pytest.importorskip("sentence_transformers").CrossEncoder
TEXTS = ["The capital of France is Paris.", "Paris is France's capital city.",
         "Bananas are yellow.", "word " * 100]


@pytest.fixture(scope="module")
async def stack(servers, tmp_path_factory):
    # heartbeat_timeout 10 s as in test_serving: the reference model loads in this process
    settings = make_settings(servers, tmp_path_factory.mktemp("embeddings-e2e"), drain_timeout=5.0,
                             heartbeat_timeout=10.0, engine_restart_max_backoff=2.0,
                             gateway_engine_dead_after=5.0,
                             gateway_port=free_port(None), scheduler_interval=1.0)
    tag = uuid.uuid4().hex[:6]
    worker = {"worker_name": f"real-{tag}", "worker_labels": {"stack": tag}}
    async with running_services(settings, worker=worker, gateway={}, name="embeddings-e2e",
                                clean=True) as stack:
        client, url = stack.client, stack.url
        name = f"minilm-{tag}"
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/api/v1/models", json={
                    "name": name, "source": str(minilm_path()), "device": "cpu",
                    "worker_selector": {"stack": tag},
                    "engine_args": {"max_num_seqs": 32, "num_threads": 1}}) as r:
                assert r.status == 201, await r.text()
                model_id = (await r.json())["id"]
        await running_instance(client, model_id)
        yield url, name, settings, client


_REFERENCE: list[object] = []


def async_api(url: str, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


async def reference(texts: list[str]) -> np.ndarray:
    """sentence-transformers' vectors, computed off the event loop the stack's services share."""
    def encode() -> np.ndarray:
        if not _REFERENCE:
            _REFERENCE.append(SentenceTransformer(str(minilm_path()), device="cpu"))
        return _REFERENCE[0].encode(texts)  # type: ignore[attr-defined]
    return await asyncio.to_thread(encode)


async def test_openai_sdk_embeddings_match_sentence_transformers(stack) -> None:
    url, name, _, _ = stack
    api = async_api(url)
    ref = await reference(TEXTS)
    out = await api.embeddings.create(model=name, input=TEXTS)  # the SDK asks for base64
    got = np.array([d.embedding for d in out.data])
    assert got.shape == (4, 384) and np.abs(got - ref).max() <= 1e-5
    assert [d.index for d in out.data] == [0, 1, 2, 3] and out.model == name
    assert out.usage.prompt_tokens == out.usage.total_tokens > 100
    floats = await api.embeddings.create(model=name, input=TEXTS[0], encoding_format="float")
    assert np.abs(np.array(floats.data[0].embedding) - ref[0]).max() <= 1e-5
    # token ids go as given: the tokenizer's own ids, with [CLS] and [SEP], give the same vector
    ids = _REFERENCE[0].tokenizer(TEXTS[0])["input_ids"]  # type: ignore[attr-defined]
    by_ids = await api.embeddings.create(model=name, input=ids)
    assert np.abs(np.array(by_ids.data[0].embedding) - ref[0]).max() <= 1e-5
    assert by_ids.usage.prompt_tokens == len(ids)


async def test_more_inputs_than_one_batch_keep_their_order(stack) -> None:
    url, name, _, _ = stack
    texts = [f"sentence number {i} about topic {i % 7}" for i in range(BATCH_INPUTS + 5)]
    out = await async_api(url).embeddings.create(model=name, input=texts)
    got = np.array([d.embedding for d in out.data])
    assert np.abs(got - await reference(texts)).max() <= 1e-5


async def test_refusals(stack) -> None:
    url, name, _, _ = stack
    api = async_api(url)
    with pytest.raises(openai.BadRequestError) as err:  # not a Matryoshka model
        await api.embeddings.create(model=name, input="x", dimensions=64)
    assert err.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as err:
        await api.embeddings.create(model=name, input="word " * 400)
    assert err.value.body["code"] == "context_length_exceeded"
    out = await api.embeddings.create(model=name, input="word " * 400,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert out.usage.prompt_tokens == 256
    with pytest.raises(openai.BadRequestError) as err:  # an embedding model does not generate
        await api.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["code"] == "wrong_model_type"
    with pytest.raises(openai.NotFoundError):
        await api.embeddings.create(model="no-such-model", input="x")


async def test_token_budget_holds_through_two_gateways_and_a_restart(stack) -> None:
    """A key's token budget on the embedding model, spent through two gateways (real tokens,
    counted by the engine), survives a gateway restart; its usage is in Postgres per day; a
    tokens-per-minute limit answers 429 with Retry-After and the x-ratelimit-*-tokens headers."""
    url, name, settings, client = stack
    ids = [101, 7592, 2088, 102]  # [CLS] hello world [SEP]: 4 tokens a request
    key = await client.create_key(ApiKeyCreate(
        name=f"budget-{uuid.uuid4().hex[:6]}", scope=ApiKeyScope.INFERENCE,
        limits=[KeyLimit(model=name, token_budget=20)]))
    locked = settings.model_copy(update={"require_api_key": True})
    async with running_gateway(locked) as url_a:
        async with running_gateway(locked) as url_b:
            for i in range(5):
                out = await async_api(url_a if i % 2 else url_b, key.secret).embeddings.create(
                    model=name, input=ids)
                assert out.usage.prompt_tokens == 4
            await wait_for_usage(client, key.id, 20)
            with pytest.raises(openai.RateLimitError) as err:
                await async_api(url_b, key.secret).embeddings.create(model=name, input=ids)
            assert err.value.body["code"] == "insufficient_quota"
    async with running_gateway(locked) as url_c:  # a new gateway: the budget stays spent
        with pytest.raises(openai.RateLimitError):
            await async_api(url_c, key.secret).embeddings.create(model=name, input=ids)
    rows = (await client.usage(UsageQuery(key_id=key.id))).rows
    assert [(r.model, r.requests, r.prompt_tokens, r.output_tokens) for r in rows] == [
        (name, 5, 20, 0)]

    tpm = await client.create_key(ApiKeyCreate(
        name=f"tpm-{uuid.uuid4().hex[:6]}", scope=ApiKeyScope.INFERENCE,
        limits=[KeyLimit(tpm=8)]))
    async with running_gateway(locked) as url_d, aiohttp.ClientSession() as http:
        left = 60 - time.time() % 60
        if left < 20:  # stay within one minute's window
            await asyncio.sleep(left + 0.05)
        headers = {"Authorization": f"Bearer {tpm.secret}"}
        for spent, expected_left in ((4, "4"), (8, "0")):  # after its own 4 tokens
            async with http.post(f"{url_d}/v1/embeddings", headers=headers,
                                 json={"model": name, "input": ids}) as r:
                assert r.status == 200
                assert r.headers["x-ratelimit-remaining-tokens"] == expected_left
            await wait_for_usage(client, tpm.id, spent)
        async with http.post(f"{url_d}/v1/embeddings", headers=headers,
                             json={"model": name, "input": ids}) as r:
            body = await r.json()
            assert r.status == 429 and body["error"]["code"] == "rate_limit_exceeded"
            assert body["error"]["type"] == "tokens"
            assert 1 <= int(r.headers["Retry-After"]) <= 60
            assert r.headers["x-ratelimit-limit-tokens"] == "8"
            assert r.headers["x-ratelimit-remaining-tokens"] == "0"


async def test_usage_of_keys_without_limits_is_batched_and_kept_at_a_stop(stack) -> None:
    """A key without limits: its usage waits in the gateway's batch (an hour here) and reaches
    the registry in one record when the gateway stops, nothing lost; with a batch of two
    requests, it is sent after the second without a stop."""
    url, name, settings, client = stack
    ids = [101, 7592, 2088, 102]  # 4 tokens a request
    key = await client.create_key(ApiKeyCreate(name=f"free-{uuid.uuid4().hex[:6]}",
                                               scope=ApiKeyScope.INFERENCE))
    hourly = settings.model_copy(update={"require_api_key": True,
                                         "gateway_usage_flush_interval": 3600.0,
                                         "gateway_usage_flush_requests": 1000})
    async with running_gateway(hourly) as url_a:
        for _ in range(3):
            await async_api(url_a, key.secret).embeddings.create(model=name, input=ids)
        assert (await client.usage(UsageQuery(key_id=key.id))).rows == []  # still batched
    rows = (await client.usage(UsageQuery(key_id=key.id))).rows
    assert [(r.model, r.requests, r.prompt_tokens) for r in rows] == [(name, 3, 12)]
    async with running_gateway(hourly.model_copy(
            update={"gateway_usage_flush_requests": 2})) as url_b:
        for _ in range(2):
            await async_api(url_b, key.secret).embeddings.create(model=name, input=ids)
        await wait_for_usage(client, key.id, 12 + 8)
    rows = (await client.usage(UsageQuery(key_id=key.id))).rows
    assert [(r.requests, r.prompt_tokens) for r in rows] == [(5, 20)]


async def wait_for_usage(client: RegistryClient, key_id: str, tokens: int) -> None:
    """Usage is recorded just after each answer: wait until the registry has it."""
    for _ in range(100):
        rows = (await client.usage(UsageQuery(key_id=key_id))).rows
        if sum(r.prompt_tokens + r.output_tokens for r in rows) >= tokens:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"usage of {key_id} never reached {tokens} tokens")


@pytest.fixture(scope="module")
async def reranker(stack, tmp_path_factory):
    """A tiny random cross-encoder (tests/tiny_models.py) deployed beside MiniLM on the same
    worker: its name and folder."""
    url, name, _, client = stack
    tag = name.removeprefix("minilm-")
    folder = save_tiny_cross_encoder(tmp_path_factory.mktemp("cross-encoder"))
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/api/v1/models", json={
                "name": f"rerank-{tag}", "source": str(folder), "device": "cpu",
                "worker_selector": {"stack": tag},
                "engine_args": {"max_num_seqs": 32, "num_threads": 1}}) as r:
            assert r.status == 201, await r.text()
            model_id = (await r.json())["id"]
    await running_instance(client, model_id)
    return f"rerank-{tag}", folder


async def test_rerank_and_score_match_cross_encoder(stack, reranker) -> None:
    """/v1/rerank (and its aliases) and /v1/score through the gateway against sentence-
    transformers' CrossEncoder; usage under a key; the metric; the refusals."""
    url, name, settings, client = stack
    model, folder = reranker
    query = "What is the capital of France?"
    docs = ["Paris is the capital of France.", "Bananas are yellow.", "France", "word " * 50]
    ref = await asyncio.to_thread(lambda: CrossEncoder(str(folder), device="cpu").predict(
        [(query, d) for d in docs]))
    key = await client.create_key(ApiKeyCreate(name=f"rerank-{uuid.uuid4().hex[:6]}",
                                               scope=ApiKeyScope.INFERENCE,
                                               limits=[KeyLimit(model=model, token_budget=10**6)]))
    locked = settings.model_copy(update={"require_api_key": True})
    async with running_gateway(locked) as gw, aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {key.secret}"}) as http:
        async with http.post(f"{gw}/v1/rerank", json={"model": model, "query": query,
                                                       "documents": docs, "top_n": 3}) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
        order = sorted(range(len(docs)), key=lambda i: -ref[i])[:3]
        assert [x["index"] for x in out["results"]] == order
        assert all(abs(x["relevance_score"] - ref[x["index"]]) <= 1e-5 for x in out["results"])
        assert out["results"][0]["document"] == {"text": docs[order[0]]}
        assert out["model"] == model and out["usage"]["prompt_tokens"] > 50
        for alias in ("/rerank", "/v2/rerank"):
            async with http.post(f"{gw}{alias}", json={"model": model, "query": query,
                                                        "documents": docs}) as r:
                assert [x["index"] for x in (await r.json())["results"]][:3] == order
        async with http.post(f"{gw}/v1/score", json={"model": model, "text_1": query,
                                                      "text_2": docs}) as r:
            scores = await r.json()
        assert [d["index"] for d in scores["data"]] == [0, 1, 2, 3]
        assert np.abs(np.array([d["score"] for d in scores["data"]]) - ref).max() <= 1e-5
        async with http.post(f"{gw}/v1/rerank", json={"model": model, "query": query,
                                                       "documents": []}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "documents"
        async with http.post(f"{gw}/v1/rerank", json={"model": name, "query": query,
                                                       "documents": docs}) as r:
            err = (await r.json())["error"]
            assert r.status == 400 and err["code"] == "wrong_model_type" and name in err["message"]
        async with http.post(f"{gw}/v1/embeddings", json={"model": model, "input": "x"}) as r:
            err = (await r.json())["error"]
            assert r.status == 400 and err["code"] == "wrong_model_type" and model in err["message"]
        async with http.get(f"{gw}/metrics") as r:
            metrics = await r.text()
        counted = f'shoal:gateway_api_requests_total{{api="rerank",model_name="{model}"}} 3.0'
        assert counted in metrics
    await wait_for_usage(client, key.id, 4 * out["usage"]["prompt_tokens"])
    rows = (await client.usage(UsageQuery(key_id=key.id))).rows
    assert [(r.model, r.requests, r.output_tokens) for r in rows] == [(model, 4, 0)]


@pytest.fixture(scope="module")
async def decoder_embedder(stack, tmp_path_factory):
    """A tiny random Qwen3 with sentence-transformers' last-token pooling files (as
    Qwen3-Embedding ships), deployed with no engine_args: the folder's modules.json makes it an
    embedder (task "auto"). Its name and folder."""
    url, name, _, client = stack
    tag = name.removeprefix("minilm-")
    folder = save_tiny_decoder_embedder(tmp_path_factory.mktemp("qwen3-embedder"))
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/api/v1/models", json={
                "name": f"qwen3-emb-{tag}", "source": str(folder), "device": "cpu",
                "worker_selector": {"stack": tag}, "engine_args": {"num_threads": 1}}) as r:
            assert r.status == 201, await r.text()
            model_id = (await r.json())["id"]
    await running_instance(client, model_id)
    return f"qwen3-emb-{tag}", folder


async def test_decoder_embedder_matches_sentence_transformers(stack, decoder_embedder) -> None:
    """Last-token pooled, normalised vectors through the gateway with the openai SDK equal
    sentence-transformers' (which pads the batch on the left); token ids as given; the model
    does not generate."""
    url, _, _, _ = stack
    model, folder = decoder_embedder
    api = async_api(url)

    def encode() -> tuple[np.ndarray, list[int]]:
        st = SentenceTransformer(str(folder), device="cpu")
        st.tokenizer.padding_side = "left"
        return st.encode(TEXTS), st.tokenizer(TEXTS[0])["input_ids"]
    ref, ids = await asyncio.to_thread(encode)
    out = await api.embeddings.create(model=model, input=TEXTS)
    got = np.array([d.embedding for d in out.data])
    assert got.shape == (4, 64) and np.abs(got - ref).max() <= 1e-5
    assert np.abs(got[0] - got[2]).max() > 0.05  # the vectors differ: the check can fail
    by_ids = await api.embeddings.create(model=model, input=ids, encoding_format="float")
    assert np.abs(np.array(by_ids.data[0].embedding) - ref[0]).max() <= 1e-5
    assert by_ids.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as err:
        await api.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["code"] == "wrong_model_type"


async def test_pooling_routes_are_traced_and_counted(stack, reranker,
                                                     gateway_traces) -> None:  # noqa: F811
    """/v1/embeddings, /v1/rerank and /v1/score each have a GenAI span ("{operation} {model}")
    under the HTTP span the client's traceparent parents, with the usage, and are counted by
    route in shoal:gateway_api_requests."""
    url, name, _, _ = stack
    model, _ = reranker
    received, processor = gateway_traces
    calls = [("/v1/embeddings", "embeddings", name, {"input": ["a b c", "d e"]}),
             ("/v1/rerank", "rerank", model, {"query": "q", "documents": ["x", "y z"]}),
             ("/v1/score", "score", model, {"text_1": "q", "text_2": ["x", "y z"]})]
    async with aiohttp.ClientSession() as http:
        for path, operation, target, body in calls:
            trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
            async with http.post(f"{url}{path}", json={"model": target, **body}, headers={
                    "traceparent": f"00-{trace_id}-{client_span}-01"}) as r:
                assert r.status == 200, await r.text()
                usage = (await r.json())["usage"]
            processor.force_flush()
            spans = {s.name: s for s in await asyncio.to_thread(
                received.wait_for, trace_id, {f"POST {path}", f"{operation} {target}"})}
            outer, inner = spans[f"POST {path}"], spans[f"{operation} {target}"]
            assert outer.parent_span_id == client_span and inner.parent_span_id == outer.span_id
            attrs = inner.attributes
            assert attrs["gen_ai.operation.name"] == operation
            assert attrs["gen_ai.request.model"] == attrs["gen_ai.response.model"] == target
            assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] > 0
            assert attrs["shoal.request.inputs"] == 2
        async with http.get(f"{url}/metrics") as r:
            metrics = await r.text()
    for api, target in (("embeddings", name), ("rerank", model), ("score", model)):
        assert f'shoal:gateway_api_requests_total{{api="{api}",model_name="{target}"}}' in metrics
