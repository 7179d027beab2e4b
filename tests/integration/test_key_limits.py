"""API key scopes and per-key limits through real gateways against the real registry (NATS +
Postgres): inference keys are refused the management API (403), admin keys are not; a key's
requests-per-minute limit holds exactly under concurrent load spread over two gateways (429 with
Retry-After, OpenAI's rate_limit_exceeded shape and x-ratelimit-* headers); the registry's
counters directly; usage per key/model/day. Requests go to models with no instance: the limit is
applied before routing, so an admitted request is a 404, a refused one a 429 (the token limits
and budgets, which need real tokens, are tested with an engine in tests/e2e)."""

from __future__ import annotations

import asyncio
import time
import uuid

import aiohttp
import pytest

from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.errors import NotFound
from shoal.shared.schemas.registry import (
    MAX_LIMIT, ApiKeyCreate, ApiKeyScope, ApiKeyUpdate, KeyLimit, QuotaAcquire, UsageQuery,
    UsageRecord
)
from tests.integration.test_gateway import running_gateway

pytestmark = pytest.mark.integration


def name() -> str:
    return f"k-{uuid.uuid4().hex[:8]}"


async def fresh_window(margin: float = 15.0) -> None:
    """Wait until a one-minute window has at least `margin` seconds left (limits are counted in
    fixed UTC minutes; a test must not straddle two)."""
    left = 60 - time.time() % 60
    if left < margin:
        await asyncio.sleep(left + 0.05)


async def test_scopes_guard_the_management_api(settings: Settings, client: RegistryClient) -> None:
    locked = settings.model_copy(update={"require_api_key": True, "gateway_key_cache_ttl": 0.2})
    admin = await client.create_key(ApiKeyCreate(name=name(), scope=ApiKeyScope.ADMIN))
    # an admin key exists, so a key created without a scope is an inference key
    plain = await client.create_key(ApiKeyCreate(name=name()))
    assert admin.scope is ApiKeyScope.ADMIN and plain.scope is ApiKeyScope.INFERENCE
    async with running_gateway(locked) as url, aiohttp.ClientSession() as http:
        def auth(key: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {key}"}

        async with http.get(f"{url}/api/v1/workers", headers=auth(plain.secret)) as r:
            body = await r.json()
            assert r.status == 403 and body["error"]["code"] == "insufficient_scope"
            assert body["error"]["type"] == "permission_error"
        async with http.get(f"{url}/v1/models", headers=auth(plain.secret)) as r:
            assert r.status == 200
        async with http.get(f"{url}/api/v1/workers", headers=auth(admin.secret)) as r:
            assert r.status == 200
        # an admin promotes the key; the gateway's cache lets it through once it expires
        async with http.patch(f"{url}/api/v1/keys/{plain.id}", headers=auth(admin.secret),
                              json={"scope": "admin", "version": plain.version}) as r:
            assert r.status == 200 and (await r.json())["scope"] == "admin"
        await asyncio.sleep(0.3)
        async with http.get(f"{url}/api/v1/workers", headers=auth(plain.secret)) as r:
            assert r.status == 200
        async with http.patch(f"{url}/api/v1/keys/{plain.id}", headers=auth(admin.secret),
                              json={"limits": [{"rpm": 0}]}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"].startswith("limits")


async def test_rpm_holds_exactly_across_two_gateways(settings: Settings,
                                                     client: RegistryClient) -> None:
    rpm, total, model = 7, 30, f"nomodel-{uuid.uuid4().hex[:6]}"
    key = await client.create_key(ApiKeyCreate(
        name=name(), scope=ApiKeyScope.INFERENCE,
        limits=[KeyLimit(model=model, rpm=rpm), KeyLimit(rpm=1000)]))
    locked = settings.model_copy(update={"require_api_key": True})
    async with running_gateway(locked) as url_a, running_gateway(locked) as url_b, \
            aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {key.secret}"}
        body = {"model": model, "prompt": "hi", "max_tokens": 1}

        async def post(url: str) -> tuple[int, dict[str, object], dict[str, str]]:
            async with http.post(f"{url}/v1/completions", json=body, headers=headers) as r:
                return r.status, await r.json(), dict(r.headers)

        await fresh_window()
        results = await asyncio.gather(*(post(url_a if i % 2 else url_b) for i in range(total)))
        statuses = [status for status, _, _ in results]
        assert statuses.count(404) == rpm and statuses.count(429) == total - rpm
        refused = [(b, h) for s, b, h in results if s == 429]
        for err, h in refused:
            assert err["error"]["code"] == "rate_limit_exceeded"  # type: ignore[index]
            assert err["error"]["type"] == "requests"  # type: ignore[index]
            assert 1 <= int(h["Retry-After"]) <= 60
            assert h["x-ratelimit-limit-requests"] == str(rpm)
            assert h["x-ratelimit-remaining-requests"] == "0"
        admitted = sorted(int(h["x-ratelimit-remaining-requests"])
                          for s, _, h in results if s == 404)
        assert admitted == list(range(rpm))  # each admission saw one fewer left
        # another model is under the all-models limit only
        async with http.post(f"{url_a}/v1/completions", headers=headers,
                             json={**body, "model": f"{model}-other"}) as r:
            assert r.status == 404 and r.headers["x-ratelimit-limit-requests"] == "1000"


async def test_registry_counters_and_usage(client: RegistryClient) -> None:
    model = f"m-{uuid.uuid4().hex[:6]}"
    key = await client.create_key(ApiKeyCreate(name=name(), scope=ApiKeyScope.INFERENCE,
                                               limits=[KeyLimit(tpm=100, token_budget=150)]))
    await fresh_window()
    grant = await client.acquire_quota(QuotaAcquire(key_id=key.id, model=model))
    assert grant.allowed and grant.limit_tokens == 100 and grant.remaining_tokens == 100
    await client.record_usage(UsageRecord(key_id=key.id, model=model, prompt_tokens=60,
                                          cached_tokens=16, output_tokens=40))
    grant = await client.acquire_quota(QuotaAcquire(key_id=key.id, model=model))
    assert not grant.allowed and grant.code == "rate_limit_exceeded" and grant.retry_after
    assert grant.remaining_tokens == 0
    # a new minute would allow it again, but the budget (150) is what stops the next 60
    await client.update_key(ApiKeyUpdate(id=key.id, limits=[KeyLimit(token_budget=150)]))
    assert (await client.acquire_quota(QuotaAcquire(key_id=key.id, model=model))).allowed
    await client.record_usage(UsageRecord(key_id=key.id, model=model, prompt_tokens=50))
    grant = await client.acquire_quota(QuotaAcquire(key_id=key.id, model=model))
    assert not grant.allowed and grant.code == "insufficient_quota"
    report = await client.usage(UsageQuery(key_id=key.id))
    assert [(r.model, r.requests, r.prompt_tokens, r.cached_tokens, r.output_tokens)
            for r in report.rows] == [(model, 2, 110, 16, 40)]


async def test_a_usage_batch_sent_twice_counts_once(client: RegistryClient) -> None:
    """A gateway retries a record whose reply timed out although the registry had committed it:
    the same batch id counts once, in the day's usage and in the minute's token window."""
    model = f"m-{uuid.uuid4().hex[:6]}"
    key = await client.create_key(ApiKeyCreate(name=name(), scope=ApiKeyScope.INFERENCE,
                                               limits=[KeyLimit(tpm=1000)]))
    await fresh_window()
    batch = UsageRecord(key_id=key.id, model=model, requests=3, prompt_tokens=60,
                        output_tokens=40, batch_id=uuid.uuid4().hex)
    await client.record_usage(batch)
    await client.record_usage(batch)  # the retry
    await client.record_usage(batch.model_copy(update={"batch_id": uuid.uuid4().hex}))  # another
    report = await client.usage(UsageQuery(key_id=key.id))
    assert [(r.requests, r.prompt_tokens, r.output_tokens) for r in report.rows] == [(6, 120, 80)]
    grant = await client.acquire_quota(QuotaAcquire(key_id=key.id, model=model))
    assert grant.remaining_tokens == 1000 - 200


async def test_usage_of_an_unknown_key_is_404_naming_it(settings: Settings,
                                                        client: RegistryClient) -> None:
    """Usage for a key_id that is no key's id or name is a 404 naming it, on the management API
    and on the bus, not an empty list (a typo must not read as "no usage"); a revoked key's
    usage is still reported, by id or by name."""
    key = await client.create_key(ApiKeyCreate(name=name(), scope=ApiKeyScope.INFERENCE))
    await client.record_usage(UsageRecord(key_id=key.id, model="m", prompt_tokens=5))
    await client.revoke_key(key.id)
    with pytest.raises(NotFound, match="'no-such-key'"):
        await client.usage(UsageQuery(key_id="no-such-key"))
    assert [r.prompt_tokens for r in (await client.usage(UsageQuery(key_id=key.name))).rows] == [5]
    async with running_gateway(settings) as url, aiohttp.ClientSession() as http:
        async with http.get(f"{url}/api/v1/usage", params={"key_id": "no-such-key"}) as r:
            body = await r.json()
            assert r.status == 404 and body["error"]["type"] == "not_found_error", body
            assert "'no-such-key'" in body["error"]["message"], body
        async with http.get(f"{url}/api/v1/usage", params={"key_id": key.id}) as r:
            body = await r.json()
            assert r.status == 200 and [row["prompt_tokens"] for row in body["items"]] == [5]


async def test_a_limit_out_of_the_counters_range_is_a_400(settings: Settings,
                                                          client: RegistryClient) -> None:
    """rpm 1e20 was accepted, and every request of that key then was a 503 (DBAPIError: the
    counters are BIGINTs): now a 400 naming the field, on create and update; the largest limit
    (MAX_LIMIT) works."""
    key = await client.create_key(ApiKeyCreate(name=name(), scope=ApiKeyScope.ADMIN))
    model = f"nomodel-{uuid.uuid4().hex[:6]}"
    async with running_gateway(settings) as url, aiohttp.ClientSession() as http:
        auth = {"Authorization": f"Bearer {key.secret}"}
        for limit in ({"rpm": 1e20}, {"tpm": 10**19}, {"token_budget": MAX_LIMIT + 1}):
            async with http.post(f"{url}/api/v1/keys", headers=auth, json={
                    "name": name(), "scope": "inference", "limits": [limit]}) as r:
                body = await r.json()
                assert r.status == 400, body
                assert body["error"]["param"] == f"limits.0.{next(iter(limit))}", body
            async with http.patch(f"{url}/api/v1/keys/{key.id}", headers=auth,
                                  json={"limits": [limit]}) as r:
                assert r.status == 400, await r.text()
        async with http.patch(f"{url}/api/v1/keys/{key.id}", headers=auth,
                              json={"version": 2**40}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "version"
        largest = await client.create_key(ApiKeyCreate(
            name=name(), scope=ApiKeyScope.INFERENCE,
            limits=[KeyLimit(rpm=MAX_LIMIT, tpm=MAX_LIMIT, token_budget=MAX_LIMIT)]))
        async with http.post(f"{url}/v1/completions", json={"model": model, "prompt": "hi"},
                             headers={"Authorization": f"Bearer {largest.secret}"}) as r:
            assert r.status == 404, await r.text()  # admitted, then no such model
            assert r.headers["x-ratelimit-limit-requests"] == str(MAX_LIMIT)


async def test_tokenize_and_detokenize_count_against_the_key(settings: Settings,
                                                             client: RegistryClient) -> None:
    """A key whose budget is spent got 200s from /tokenize and /detokenize: now they go through
    its limits like any request (429), and count against its rpm (no tokens: no usage)."""
    model = f"nomodel-{uuid.uuid4().hex[:6]}"
    spent = await client.create_key(ApiKeyCreate(name=name(), scope=ApiKeyScope.INFERENCE,
                                                 limits=[KeyLimit(token_budget=10)]))
    await client.record_usage(UsageRecord(key_id=spent.id, model=model, prompt_tokens=10))
    per_minute = await client.create_key(ApiKeyCreate(name=name(), scope=ApiKeyScope.INFERENCE,
                                                      limits=[KeyLimit(rpm=2)]))
    locked = settings.model_copy(update={"require_api_key": True})
    await fresh_window()
    async with running_gateway(locked) as url, aiohttp.ClientSession() as http:
        for path, body in (("/tokenize", {"model": model, "prompt": "hi"}),
                           ("/detokenize", {"model": model, "tokens": [1, 2]})):
            async with http.post(f"{url}{path}", json=body,
                                 headers={"Authorization": f"Bearer {spent.secret}"}) as r:
                error = (await r.json())["error"]
                assert r.status == 429 and error["code"] == "insufficient_quota", (path, error)
            async with http.post(f"{url}{path}", json=body,
                                 headers={"Authorization": f"Bearer {per_minute.secret}"}) as r:
                assert r.status == 404, (path, await r.text())  # admitted: no such model
        async with http.post(f"{url}/tokenize", json={"model": model, "prompt": "hi"},
                             headers={"Authorization": f"Bearer {per_minute.secret}"}) as r:
            assert r.status == 429 and (await r.json())["error"]["type"] == "requests"
    assert (await client.usage(UsageQuery(key_id=per_minute.id))).rows == []


async def test_a_budget_only_key_gets_the_token_headers(settings: Settings,
                                                        client: RegistryClient) -> None:
    """A token_budget-only key sent no x-ratelimit headers: it gets x-ratelimit-limit-tokens
    and -remaining-tokens (a budget never resets: no reset header); with a tpm too, the
    tightest of the two is reported."""
    model = f"nomodel-{uuid.uuid4().hex[:6]}"
    key = await client.create_key(ApiKeyCreate(name=name(), scope=ApiKeyScope.INFERENCE,
                                               limits=[KeyLimit(token_budget=1000)]))
    await client.record_usage(UsageRecord(key_id=key.id, model=model, prompt_tokens=100))
    both = await client.create_key(ApiKeyCreate(name=name(), scope=ApiKeyScope.INFERENCE,
                                                limits=[KeyLimit(token_budget=1000, tpm=500)]))
    locked = settings.model_copy(update={"require_api_key": True})
    await fresh_window()
    async with running_gateway(locked) as url, aiohttp.ClientSession() as http:
        body = {"model": model, "prompt": [1, 2, 3, 4], "max_tokens": 6}  # reserves 4 + 6
        async with http.post(f"{url}/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key.secret}"}) as r:
            assert r.status == 404
            assert r.headers["x-ratelimit-limit-tokens"] == "1000"
            assert r.headers["x-ratelimit-remaining-tokens"] == str(1000 - 100 - 10)
            assert "x-ratelimit-reset-tokens" not in r.headers
            assert "x-ratelimit-limit-requests" not in r.headers
        async with http.post(f"{url}/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {both.secret}"}) as r:
            assert r.status == 404
            assert r.headers["x-ratelimit-limit-tokens"] == "500"
            assert r.headers["x-ratelimit-remaining-tokens"] == "490"
            assert r.headers["x-ratelimit-reset-tokens"].endswith("s")


async def test_token_reservations_hold_under_concurrency_and_settle(
        client: RegistryClient) -> None:
    """Admissions reserve their tokens: 16 concurrent acquires of 30 tokens against a tpm of
    100 admit exactly 3 (before, all 16: only finished requests were counted); settling gives
    the unused part back, and a refusal with no usage gives all of it back. A reservation
    larger than the limit can never fit (no Retry-After); a budget counts reservations."""
    model = f"m-{uuid.uuid4().hex[:6]}"
    key = await client.create_key(ApiKeyCreate(name=name(), scope=ApiKeyScope.INFERENCE,
                                               limits=[KeyLimit(tpm=100)]))
    await fresh_window()
    grants = await asyncio.gather(*(client.acquire_quota(QuotaAcquire(
        key_id=key.id, model=model, tokens=30)) for _ in range(16)))
    admitted = [g for g in grants if g.allowed]
    assert len(admitted) == 3 and all(g.reservation_id for g in admitted)
    assert sorted(g.remaining_tokens for g in admitted) == [10, 40, 70]
    refused = [g for g in grants if not g.allowed]
    assert all(g.code == "rate_limit_exceeded" and g.retry_after for g in refused)
    assert "Requested 30" in refused[0].message
    first, second, third = admitted
    await client.record_usage(UsageRecord(key_id=key.id, model=model, prompt_tokens=5,
                                          output_tokens=7, reservation_id=first.reservation_id))
    await client.record_usage(UsageRecord(key_id=key.id, model=model, requests=0,
                                          reservation_id=second.reservation_id))
    grant = await client.acquire_quota(QuotaAcquire(key_id=key.id, model=model, tokens=0))
    assert grant.remaining_tokens == 100 - 12 - 30  # the third is still reserved
    too_big = await client.acquire_quota(QuotaAcquire(key_id=key.id, model=model, tokens=101))
    assert not too_big.allowed and too_big.retry_after is None
    assert "can never fit" in too_big.message

    budget = await client.create_key(ApiKeyCreate(
        name=name(), scope=ApiKeyScope.INFERENCE, limits=[KeyLimit(token_budget=50)]))
    grant = await client.acquire_quota(QuotaAcquire(key_id=budget.id, model=model,
                                                    tokens=20 * 8 * 64 + 20))
    assert not grant.allowed and grant.code == "insufficient_quota"
    held = await client.acquire_quota(QuotaAcquire(key_id=budget.id, model=model, tokens=40))
    assert held.allowed and held.remaining_tokens == 10
    grant = await client.acquire_quota(QuotaAcquire(key_id=budget.id, model=model, tokens=20))
    assert not grant.allowed and grant.code == "insufficient_quota"  # 40 are reserved
    await client.record_usage(UsageRecord(key_id=budget.id, model=model, prompt_tokens=8,
                                          output_tokens=2, reservation_id=held.reservation_id))
    grant = await client.acquire_quota(QuotaAcquire(key_id=budget.id, model=model, tokens=20))
    assert grant.allowed and grant.remaining_tokens == 50 - 10 - 20
    report = await client.usage(UsageQuery(key_id=budget.id))
    assert [(r.requests, r.prompt_tokens, r.output_tokens) for r in report.rows] == [(1, 8, 2)]
