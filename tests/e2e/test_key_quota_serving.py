"""A key's token limits with real tokens, and /tokenize beside serving (issue 24): registry,
scheduler, a worker running SmolLM2 in an engine process, and gateways that require keys.

One batched completion (20 prompts, n=8, max_tokens 64) spent 205x a token_budget of 50, and
16 parallel chats 10x a tpm of 100, because token limits were checked against finished requests
only: now each request reserves the most it can spend at admission and settles to its usage.
A large /tokenize ran on the engine's event loop, which then published no load for seconds (the
gateways routed around it) and served nothing else: now it runs beside the serving.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import aiohttp
import pytest

from shoal.services.engine.model_prep import smollm2_gguf_path
from shoal.shared.embedded import free_port
from shoal.shared.schemas.registry import (
    ApiKeyCreate, ApiKeyScope, KeyLimit, ModelCreate, UsageQuery
)
from tests.e2e.test_serving import running_instance
from tests.integration.conftest import make_settings, running_services

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MAX_MODEL_LEN = 8192
"""SmolLM2's own context: the largest /tokenize the engine takes is then about a megabyte."""


@pytest.fixture(scope="module")
async def stack(servers, tmp_path_factory):
    settings = make_settings(servers, tmp_path_factory.mktemp("quota-e2e"), heartbeat_timeout=10.0,
                             gateway_port=free_port(None), scheduler_interval=1.0,
                             gateway_engine_dead_after=2.0, gateway_accept_timeout=60.0,
                             require_api_key=True)
    async with running_services(settings, worker={"worker_name": f"quota-{uuid.uuid4().hex[:6]}"},
                                gateway={}, name="quota-e2e") as stack:
        client = stack.client
        model = await client.create_model(ModelCreate(
            name=f"quota-{uuid.uuid4().hex[:6]}", source=str(smollm2_gguf_path()), device="cpu",
            max_model_len=MAX_MODEL_LEN, worker_selector=stack.selector,
            engine_args={"max_num_seqs": 16, "kv_cache_memory": 128 * 2**20}))
        await running_instance(client, model.id)
        yield stack.url, model.name, client


async def new_key(client, **limit: int):
    return await client.create_key(ApiKeyCreate(name=f"q-{uuid.uuid4().hex[:8]}",
                                                scope=ApiKeyScope.INFERENCE,
                                                limits=[KeyLimit(**limit)]))


async def spent(client, key_id: str, requests: int) -> int:
    """The key's tokens once the registry has the usage of `requests` answered requests (it is
    recorded just after each answer)."""
    for _ in range(200):
        rows = (await client.usage(UsageQuery(key_id=key_id))).rows
        if sum(r.requests for r in rows) >= requests:
            return sum(r.prompt_tokens + r.output_tokens for r in rows)
        await asyncio.sleep(0.05)
    raise AssertionError(f"the usage of {requests} requests of {key_id} never arrived")


async def fresh_window(margin: float = 25.0) -> None:
    """Stay within one minute's token window."""
    left = 60 - time.time() % 60
    if left < margin:
        await asyncio.sleep(left + 0.05)


async def test_a_batched_completion_cannot_spend_a_budget_many_times(stack) -> None:
    url, model, client = stack
    key = await new_key(client, token_budget=50)
    auth = {"Authorization": f"Bearer {key.secret}"}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/completions", headers=auth, json={
                "model": model, "prompt": ["The capital of France is"] * 20, "n": 8,
                "max_tokens": 64}) as r:
            body = await r.json()
            assert r.status == 429, body
            assert body["error"]["code"] == "insufficient_quota", body
        answered = 0
        for _ in range(10):  # 6 prompt + 8 output tokens at most: three fit in 50
            async with http.post(f"{url}/v1/completions", headers=auth, json={
                    "model": model, "prompt": "The capital of France is",
                    "max_tokens": 8}) as r:
                if r.status == 429:
                    break
                assert r.status == 200, await r.text()
                answered += 1
                assert r.headers["x-ratelimit-limit-tokens"] == "50"
                await spent(client, key.id, answered)  # settled before the next one
    assert answered >= 3
    assert await spent(client, key.id, answered) <= 50


async def test_parallel_chats_stay_within_the_tokens_per_minute(stack) -> None:
    url, model, client = stack
    key = await new_key(client, tpm=100)
    auth = {"Authorization": f"Bearer {key.secret}"}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    await fresh_window()
    async with aiohttp.ClientSession() as http:
        async def post() -> tuple[int, dict]:
            async with http.post(f"{url}/v1/chat/completions", headers=auth, json=chat) as r:
                return r.status, await r.json()

        results = await asyncio.gather(*(post() for _ in range(16)))
    statuses = sorted(status for status, _ in results)
    answered = statuses.count(200)
    assert answered >= 1 and set(statuses) == {200, 429}, results
    assert all(body["error"]["type"] == "tokens" for status, body in results if status == 429)
    used = await spent(client, key.id, answered)
    assert used <= 100, (used, statuses)


async def test_a_failed_request_gives_its_reservation_back(stack) -> None:
    """A request the engine refuses (a token id beyond the vocabulary) spends nothing and holds
    nothing: the budget it had reserved is whole for the next one."""
    url, model, client = stack
    key = await new_key(client, token_budget=100)
    auth = {"Authorization": f"Bearer {key.secret}"}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/completions", headers=auth, json={
                "model": model, "prompt": [1, 2, 10**8], "max_tokens": 90}) as r:
            assert r.status == 400, await r.text()
        for _ in range(50):
            async with http.post(f"{url}/v1/completions", headers=auth, json={
                    "model": model, "prompt": [1, 2, 3], "max_tokens": 90}) as r:
                # admitted only once the refused one's 93 tokens are given back
                assert r.status in (200, 429), await r.text()
                if r.status == 200:
                    break
            await asyncio.sleep(0.1)  # the release is sent just after the answer
        assert r.status == 200


async def test_large_tokenizes_do_not_hold_the_engine(stack) -> None:
    """Four /tokenize of 900 kB (what a NATS server with the default 1 MiB max_payload
    carries; 900 kB of spaces take this tokenizer 1.5 s and are 14k tokens, an answer that fits
    it too), then a chat: the chat is answered before the last of them (the engine's event loop
    kept serving and publishing its load, so the gateway did not route around it). Before, they
    ran on that loop: the chat waited for all four, or got a 503. A /detokenize of more ids
    than the context holds is a 400 naming the limit."""
    url, model, client = stack
    key = await new_key(client, rpm=1000)
    auth = {"Authorization": f"Bearer {key.secret}"}
    text = " " * 900_000
    order: list[str] = []
    async with aiohttp.ClientSession() as http:
        async def tokenize() -> None:
            async with http.post(f"{url}/tokenize", headers=auth,
                                 json={"model": model, "prompt": text}) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["count"] > MAX_MODEL_LEN
            order.append("tokenize")

        async def chat() -> None:
            async with http.post(f"{url}/v1/chat/completions", headers=auth, json={
                    "model": model, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2}) as r:
                assert r.status == 200, await r.text()
            order.append("chat")

        big = [asyncio.create_task(tokenize()) for _ in range(4)]
        await asyncio.sleep(0.5)  # so the tokenizes are the first to reach the engine
        await asyncio.gather(chat(), *big)
        assert order.index("chat") < len(big), order  # not after the last tokenize
        async with http.post(f"{url}/detokenize", headers=auth, json={
                "model": model, "tokens": [1] * (MAX_MODEL_LEN + 1)}) as r:
            error = (await r.json())["error"]
            assert r.status == 400 and error["param"] == "tokens", error
            assert str(MAX_MODEL_LEN) in error["message"], error
