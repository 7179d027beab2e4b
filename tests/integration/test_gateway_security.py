"""The gateway against hostile input and hostile pages (issue 24), on the real registry (NATS +
Postgres), no engine: bytes that are not text in a header, numbers JSON cannot carry, floods of
made-up keys, keys presented to an open stack, and cross-site or rebound requests."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.bus.client import Bus
from shoal.shared.schemas.events import ApiKeyEvent
from shoal.shared.schemas.registry import ApiKeyCreate
from tests.integration.test_gateway import running_gateway
from tests.integration.test_gateway_edges import SHAPE, captured_logs, raw_http

pytestmark = pytest.mark.integration
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
async def open_gw(settings: Settings, registry) -> AsyncIterator[str]:
    """A gateway with the defaults: keys not required."""
    async with running_gateway(settings) as url:
        yield url


@pytest.fixture(scope="module")
async def locked_gw(settings: Settings, registry) -> AsyncIterator[str]:
    async with running_gateway(settings.model_copy(update={"require_api_key": True})) as url:
        yield url


@pytest.fixture(scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def _key_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


# ---------------------------------------------------------------- item 7: bad bytes, bad numbers
async def test_header_bytes_that_are_not_utf8_are_a_400_on_any_route(
        open_gw: str, locked_gw: str, client: RegistryClient, tmp_path: Path) -> None:
    """A `baggage` header with a byte that is not UTF-8 was a 500 on every traced route (the
    tracing propagator failed outside every handler); `Bearer <secret>\\xff\\xfe` with keys
    required was a 500 with a traceback per request. Both are malformed requests: 400, in
    OpenAI's shape, naming the header, logged without a traceback or the secret."""
    key = await client.create_key(ApiKeyCreate(name=_key_name("bytes")))
    with captured_logs(tmp_path / "run.log") as log_file:
        for url in (open_gw, locked_gw):
            for path in ("/v1/models", "/api/v1/models", "/ui/", "/v1/chat/completions"):
                for header in (b"baggage: k=v\xff", b"baggage: k=\xff\xfe",
                               b"Authorization: Bearer " + key.secret.encode() + b"\xff\xfe",
                               b"X-Custom: \xc3"):
                    request = (b"GET " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                               + header + b"\r\n\r\n")
                    status, headers, body = await raw_http(url, request)
                    assert status == 400, (url, path, header, body)
                    assert headers["content-type"].startswith("application/json")
                    error = json.loads(body)["error"]
                    assert set(error) == SHAPE and error["code"] == "invalid_header", error
                    assert error["param"] == header.split(b":")[0].decode().lower(), error
                    assert key.secret not in body.decode()
    text = log_file.read_text()
    assert "Traceback" not in text and "unexpected error" not in text
    assert key.secret not in text and key.secret[len("sk-shoal-"):] not in text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_numbers_json_cannot_carry_are_a_400_naming_the_param(
        open_gw: str, http: aiohttp.ClientSession, path: str) -> None:
    """`repetition_penalty: 1e309` is infinity once parsed; it reached the engine as null and came
    back a 503 "malformed reply from the engine" with Retry-After, which SDKs retry. Any number
    that is not finite (1e309, -1e309, NaN, Infinity) is a 400 naming where it is, never
    retried."""
    base = CHAT if path == "/v1/chat/completions" else {"model": "m", "prompt": "hi"}
    for raw, param in (('"repetition_penalty": 1e309', "repetition_penalty"),
                       ('"temperature": NaN', "temperature"),
                       ('"top_p": Infinity', "top_p"),
                       ('"presence_penalty": -1e400', "presence_penalty"),
                       ('"frequency_penalty": -Infinity', "frequency_penalty"),
                       ('"logit_bias": {"5": 1e999}', "logit_bias.5"),
                       ('"vllm_xargs": {"a": [1, 2e308]}', "vllm_xargs.a.1")):
        body = json.dumps(base)[:-1] + ", " + raw + "}"
        async with http.post(f"{open_gw}{path}", data=body,
                             headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400, (raw, r.status, await r.text())
            assert "Retry-After" not in r.headers
            error = (await r.json())["error"]
        assert set(error) == SHAPE and error["param"] == param, (raw, error)
        assert "finite" in error["message"], error


# ---------------------------------------------------------------- item 6: floods of made-up keys
async def test_a_flood_of_made_up_keys_evicts_no_valid_key(
        settings: Settings, registry, bus: Bus, client: RegistryClient,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Refusals were cached beside valid keys in one 10,000-entry LRU: 10,001 made-up bearer
    tokens evicted every valid key, and with Postgres (here: the registry) away the next request
    with a valid key was a 503 instead of being served from its last verification. The cache's
    bound is 300 here, so the flood takes seconds (tests/unit/gateway/test_gateway_auth.py
    floods the real 10,000-entry cache)."""
    from shoal.services.gateway.auth import keys as auth

    monkeypatch.setattr(auth, "MAX_CACHED_KEYS", 300)
    monkeypatch.setattr(auth, "MAX_REFUSED_KEYS", 100, raising=False)
    MAX_CACHED_KEYS = auth.MAX_CACHED_KEYS
    update = {"require_api_key": True, "gateway_key_cache_ttl": 0.5,
              "gateway_key_stale_max": 600.0}
    # The key's creation event makes a gateway forget the key: let it pass before the gateway
    # starts, or (the registry's outbox relay lagging on a loaded machine) it lands after the
    # first verification and the key is rightly no longer cached when the registry goes away.
    created: asyncio.Queue[str] = asyncio.Queue()

    async def on_event(event: ApiKeyEvent, msg: object) -> None:
        created.put_nowait(event.id)

    sub = await bus.subscribe(bus.subjects.events_of("keys"), ApiKeyEvent, on_event)
    try:
        key = await client.create_key(ApiKeyCreate(name=_key_name("flooded")))
        while await asyncio.wait_for(created.get(), 30) != key.id:
            pass
    finally:
        await sub.unsubscribe()
    async with running_gateway(settings.model_copy(update=update)) as url, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as http:
        async def models(secret: str) -> int:
            async with http.get(f"{url}/v1/models",
                                headers={"Authorization": f"Bearer {secret}"}) as r:
                return r.status

        assert await models(key.secret) == 200  # verified: cached
        for start in range(0, 2 * MAX_CACHED_KEYS, 100):
            made_up = [f"sk-shoal-{uuid.uuid4().hex}{i}" for i in range(start, start + 100)]
            statuses = await asyncio.gather(*(models(s) for s in made_up))
            assert set(statuses) == {401}
        await registry.stop()  # the registry (and so Postgres) away
        try:
            await asyncio.sleep(0.6)  # past the TTL: the gateway has to ask, and cannot
            assert await models(key.secret) == 200  # served from its last verification
            assert await models(f"sk-shoal-{uuid.uuid4().hex}") == 503  # never verified
        finally:
            await registry.start()


# ---------------------------------------------------------------- item 3: keys on an open stack
def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def test_a_key_presented_to_an_open_gateway_is_honoured(
        open_gw: str, http: aiohttp.ClientSession, client: RegistryClient) -> None:
    """Without SHOAL_REQUIRE_API_KEY, an inference key reached the management API, `Bearer
    garbage` got 200 and limits never answered 429. A request without a key is still served
    (as vLLM without --api-key); one with a Shoal key gets exactly that key."""
    from shoal.shared.schemas.registry import ApiKeyScope, KeyLimit

    admin = await client.create_key(ApiKeyCreate(name=_key_name("adm"), scope=ApiKeyScope.ADMIN))
    app = await client.create_key(ApiKeyCreate(name=_key_name("inf"),
                                               scope=ApiKeyScope.INFERENCE))
    revoked = await client.create_key(ApiKeyCreate(name=_key_name("old")))
    await client.revoke_key(revoked.id)
    made_up = f"sk-shoal-{uuid.uuid4().hex}"
    for headers, path, status in (
            ({}, "/api/v1/models", 200),  # no key: the open default
            (_bearer("EMPTY"), "/api/v1/models", 200),  # a placeholder is no key (vLLM's)
            ({"Authorization": "Basic dXNlcjpwdw=="}, "/api/v1/models", 200),
            (_bearer(admin.secret), "/api/v1/models", 200),
            (_bearer(app.secret), "/v1/models", 200),
            (_bearer(app.secret), "/api/v1/models", 403),  # its scope
            (_bearer(app.secret), "/api/v1/keys", 403),
            (_bearer(made_up), "/v1/models", 401),  # a key that is not one
            (_bearer(revoked.secret), "/v1/models", 401)):
        async with http.get(f"{open_gw}{path}", headers=headers) as r:
            assert r.status == status, (headers, path, await r.text())
            if status == 401:
                error = (await r.json())["error"]
                assert error["code"] == "invalid_api_key"
                assert "does not require keys" in error["message"]
    limited = await client.create_key(ApiKeyCreate(
        name=_key_name("lim"), scope=ApiKeyScope.INFERENCE, limits=[KeyLimit(rpm=1)]))
    statuses = []
    for _ in range(2):  # counts against rpm even when refused (an unknown model): README
        async with http.post(f"{open_gw}/v1/chat/completions", json=CHAT,
                             headers=_bearer(limited.secret)) as r:
            statuses.append(r.status)
            assert r.headers.get("x-ratelimit-limit-requests") == "1"
    assert statuses == [404, 429]
    async with http.post(f"{open_gw}/v1/chat/completions", json=CHAT) as r:
        assert r.status == 404  # the same request without the key: not limited


async def test_the_gateway_says_whether_keys_are_required(
        open_gw: str, locked_gw: str, http: aiohttp.ClientSession,
        client: RegistryClient) -> None:
    """GET /api/v1/auth (the dashboard's notice) and the bus answer `shoal keys create` warns
    from; a fixed or required key is not asked about for a token no registry key looks like."""
    from shoal.shared.schemas.registry import ApiKeyScope

    admin = await client.create_key(ApiKeyCreate(name=_key_name("who"), scope=ApiKeyScope.ADMIN))
    async with http.get(f"{open_gw}/api/v1/auth") as r:
        assert await r.json() == {"keys_required": False, "fixed_key": False, "key": None}
    async with http.get(f"{locked_gw}/api/v1/auth", headers=_bearer(admin.secret)) as r:
        body = await r.json()
    assert body["keys_required"] is True and body["key"] == {
        "id": admin.id, "name": admin.name, "scope": "admin"}
    async with http.get(f"{locked_gw}/v1/models", headers=_bearer("EMPTY")) as r:
        assert r.status == 401  # required: a placeholder is refused
        assert "does not require" not in (await r.json())["error"]["message"]



# ---------------------------------------------------------------- item 2: cross-site and rebinding
async def test_json_routes_need_a_json_content_type(open_gw: str, client: RegistryClient) -> None:
    """A body with no Content-Type was read as JSON: what a cross-site `no-cors` fetch with a
    Blob sends. Every JSON route (management and OpenAI) now answers 400 naming it."""
    import httpx

    name = _key_name("no-type")
    deploy = json.dumps({"name": name, "source": "/x.gguf", "replicas": 0}).encode()
    async with httpx.AsyncClient(base_url=open_gw) as http:
        for method, path, body in (("POST", "/api/v1/models", deploy),
                                   ("POST", "/api/v1/keys", b'{"name": "k"}'),
                                   ("PATCH", "/api/v1/models/x", b'{"replicas": 2}'),
                                   ("POST", "/v1/chat/completions", json.dumps(CHAT).encode()),
                                   ("POST", "/v1/completions", b'{"model": "m", "prompt": "a"}'),
                                   ("POST", "/tokenize", b'{"model": "m", "prompt": "a"}')):
            r = await http.request(method, path, content=body)  # httpx sends no Content-Type
            assert r.status_code == 400, (path, r.text)
            error = r.json()["error"]
            assert error["param"] == "Content-Type" and error["code"] == "invalid_content_type"
            assert "got none" in error["message"], error
        assert name not in [m.name for m in await client.list_models()]
        r = await http.post("/api/v1/models", content=deploy,
                            headers={"Content-Type": "application/json"})
        assert r.status_code == 201  # the same body, typed: deployed
        assert (await http.delete(f"/api/v1/models/{name}")).status_code == 200


async def test_hosts_that_are_not_the_gateways_are_refused(settings: Settings, registry,
                                                           open_gw: str) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=open_gw) as http:
        for host in ("localhost:1", "127.0.0.1", "[::1]:8000", "10.9.8.7"):
            r = await http.get("/v1/models", headers={"Host": host})
            assert r.status_code == 200, host
        for host in ("rebound.test:8000", "localhost.attacker.example"):
            for method, path in (("GET", "/v1/models"), ("POST", "/api/v1/models"),
                                 ("GET", "/ui/")):
                r = await http.request(method, path, headers={"Host": host})
                assert r.status_code == 400, (host, path)
                error = r.json()["error"]
                assert error["code"] == "host_not_allowed" and error["param"] == "host"
                assert "SHOAL_GATEWAY_ALLOWED_HOSTS" in error["message"]
        assert (await http.get("/health", headers={"Host": "rebound.test"})).status_code == 200
    extra = {"gateway_allowed_hosts": "shoal.example.com,gateway"}
    async with running_gateway(settings.model_copy(update=extra)) as url, \
            httpx.AsyncClient(base_url=url) as http:
        for host in ("shoal.example.com", "Gateway:8000", "localhost"):
            assert (await http.get("/v1/models", headers={"Host": host})).status_code == 200
        assert (await http.get("/v1/models", headers={"Host": "other"})).status_code == 400
    async with running_gateway(settings.model_copy(update={"gateway_allowed_hosts": "*"})) \
            as url, httpx.AsyncClient(base_url=url) as http:
        assert (await http.get("/v1/models", headers={"Host": "other"})).status_code == 200


async def test_browsers_from_another_origin_are_refused(open_gw: str) -> None:
    import httpx

    deploy = {"name": _key_name("xo"), "source": "/x.gguf", "replicas": 0}
    async with httpx.AsyncClient(base_url=open_gw) as http:
        for headers in ({"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"},
                        {"Origin": "http://localhost:9999"}, {"Origin": "null"}):
            for method, path in (("POST", "/api/v1/models"), ("GET", "/api/v1/keys"),
                                 ("POST", "/v1/chat/completions")):
                r = await http.request(method, path, headers=headers, json=deploy)
                assert r.status_code == 403, (headers, path, r.text)
                error = r.json()["error"]
                assert error["code"] == "cross_origin", error
        own = open_gw.removeprefix("http://")
        r = await http.post("/api/v1/models", json=deploy,
                            headers={"Origin": f"http://{own}", "Sec-Fetch-Site": "same-origin"})
        assert r.status_code == 201
        r = await http.get("/v1/models", headers={"Sec-Fetch-Site": "cross-site"})
        assert r.status_code == 200  # reading the model list changes nothing
        assert (await http.delete(f"/api/v1/models/{deploy['name']}")).status_code == 200
