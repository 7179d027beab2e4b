"""The gateway's HTTP edge against the real registry (NATS + Postgres), no engine: what aiohttp's
server answers itself (malformed headers) is OpenAI-shaped, no secret reaches a log, bodies that
are too deep, too large or not JSON are 4xx, admission counts a batched completion's prompts,
and a revoked key stops working at once on every gateway (issue 15)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import openai
import pytest

from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.schemas.registry import (
    ApiKeyCreate, DeviceStatus, InstanceCreate, InstanceTransition, ModelCreate, Placement,
    WorkerRegister,
)
from shoal.shared.states import InstanceState
from tests.integration.test_gateway import running_gateway, sdk

pytestmark = pytest.mark.integration
SHAPE = {"message", "type", "param", "code"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@contextlib.contextmanager
def captured_logs(path: Path) -> Iterator[Path]:
    """Every log record of this process (gateway, registry, nats client) at DEBUG, to a file."""
    root = logging.getLogger()
    handler = logging.FileHandler(path)
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield path
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        handler.close()


async def raw_http(url: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send bytes as they are (no client library would send a malformed header)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(":") for line in lines[1:] if line)}
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 10)
        return int(lines[0].split()[1]), headers, body
    finally:
        writer.close()


@pytest.fixture(scope="module")
async def locked(settings: Settings, registry) -> AsyncIterator[str]:
    """A gateway that requires keys, with a key cache that would trust a key for an hour."""
    update = {"require_api_key": True, "gateway_key_cache_ttl": 3600.0}
    async with running_gateway(settings.model_copy(update=update)) as url:
        yield url


async def test_malformed_headers_are_openai_shaped_and_no_secret_is_logged(
        locked: str, client: RegistryClient, tmp_path: Path) -> None:
    key = await client.create_key(ApiKeyCreate(name=f"edge-{uuid.uuid4().hex[:6]}"))
    made_up = "sk-shoal-" + uuid.uuid4().hex  # a secret that no key has
    with captured_logs(tmp_path / "run.log") as log_file:
        assert (await sdk(locked, key.secret).models.list()).object == "list"
        with pytest.raises(openai.AuthenticationError):
            await sdk(locked, made_up).models.list()
        for secret in (key.secret, made_up):
            for bad in (f"Authorization: Bearer {secret}\nX-Next: 1\r\n",  # a bare line feed
                        f"Authorization: Bearer {secret}\x00\r\n",
                        f"Authorization : Bearer {secret}\r\n",
                        f"X-\x7fBad: {secret}\r\n"):
                request = f"GET /v1/models HTTP/1.1\r\nHost: x\r\n{bad}\r\n".encode("latin-1")
                status, headers, body = await raw_http(locked, request)
                assert status == 400, bad
                assert headers["content-type"].startswith("application/json")
                error = json.loads(body)["error"]
                assert set(error) == SHAPE and error["type"] == "invalid_request_error"
                assert secret not in body.decode()
        status, _, body = await raw_http(locked, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
                                                 b"X-Long: " + b"a" * 70000 + b"\r\n\r\n")
        assert status in (400, 431) and set(json.loads(body)["error"]) == SHAPE
    text = log_file.read_text()
    assert "HTTP 400 from the server itself" in text  # the run was logged, at DEBUG...
    for secret in (key.secret, made_up):  # ...and no secret is anywhere in it
        assert secret not in text and secret[len("sk-shoal-"):] not in text


async def test_a_revoked_key_stops_working_at_once_on_every_gateway(
        settings: Settings, locked: str, client: RegistryClient) -> None:
    update = {"require_api_key": True, "gateway_key_cache_ttl": 3600.0}
    async with running_gateway(settings.model_copy(update=update)) as other:
        key = await client.create_key(ApiKeyCreate(name=f"revoke-{uuid.uuid4().hex[:6]}"))
        other_key = await client.create_key(ApiKeyCreate(name=f"keep-{uuid.uuid4().hex[:6]}"))
        for url in (locked, other):  # now cached as valid for an hour on both gateways
            for secret in (key.secret, other_key.secret):
                assert (await sdk(url, secret).models.list()).object == "list"
        await client.revoke_key(key.id)
        revoked_at = time.monotonic()
        for url in (locked, other):
            while True:
                try:
                    await sdk(url, key.secret).models.list()
                except openai.AuthenticationError:
                    break
                assert time.monotonic() - revoked_at < 2.0, f"{url} still takes the revoked key"
                await asyncio.sleep(0.02)
            assert (await sdk(url, other_key.secret).models.list()).object == "list"


@pytest.fixture(scope="module")
async def gateway(settings: Settings, registry) -> AsyncIterator[str]:
    small = {"gateway_max_body_bytes": 256 * 1024, "gateway_max_outstanding": 4}
    async with running_gateway(settings.model_copy(update=small)) as url:
        yield url


@pytest.fixture(scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_bodies_too_deep_not_json_or_too_large(gateway: str,
                                                     http: aiohttp.ClientSession) -> None:
    deep = b'{"model": "m", "prompt": ' + b"[" * 10000 + b"]" * 10000 + b"}"
    for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                         ("POST", "/tokenize"), ("POST", "/detokenize"),
                         ("POST", "/api/v1/models"), ("POST", "/api/v1/keys"),
                         ("PATCH", "/api/v1/models/x")):
        async with http.request(method, f"{gateway}{path}", data=deep,
                                headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400, (path, await r.text())
            error = (await r.json())["error"]
        assert error["code"] == "invalid_json" and "nests deeper" in error["message"], path
        async with http.request(method, f"{gateway}{path}", data=json.dumps(CHAT),
                                headers={"Content-Type": "text/plain"}) as r:
            assert r.status == 400, path
            assert (await r.json())["error"]["param"] == "Content-Type", path
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 300 * 1024}]}
    for path, body in (("/v1/chat/completions", big), ("/tokenize", big),
                       ("/v1/completions", {"model": "m", "prompt": "x" * 300 * 1024})):
        async with http.post(f"{gateway}{path}", json=body) as r:
            assert r.status == 413, path
            error = (await r.json())["error"]
        assert set(error) == SHAPE and error["code"] == "request_too_large", path
    async with http.post(f"{gateway}/v1/chat/completions", json=CHAT,
                         headers={"Content-Type": "application/json; charset=utf-8"}) as r:
        assert r.status == 404  # JSON with a charset is JSON: past validation, an unknown model


async def test_a_batched_completion_costs_its_prompts(gateway: str,
                                                      http: aiohttp.ClientSession) -> None:
    """SHOAL_GATEWAY_MAX_OUTSTANDING is 4 here: 5 prompts (or 2 prompts x n=3) can never fit."""
    for body, param in (({"prompt": ["a"] * 5}, "prompt"), ({"prompt": ["a", "b"], "n": 3},
                                                            "prompt"),
                        ({"prompt": "a", "n": 5}, "n")):
        async with http.post(f"{gateway}/v1/completions", json={"model": "m", **body}) as r:
            assert r.status == 400, body
            error = (await r.json())["error"]
        assert error["param"] == param and "SHOAL_GATEWAY_MAX_OUTSTANDING" in error["message"]
    async with http.post(f"{gateway}/v1/completions",
                         json={"model": "m", "prompt": ["a"] * 4}) as r:
        assert r.status == 404  # admitted: then the unknown model


async def test_a_request_the_bus_cannot_carry_is_413(settings: Settings, registry,
                                                     client: RegistryClient, bus: Bus) -> None:
    """A gateway whose body limit is above the NATS server's max_payload (a misconfiguration,
    or an external NATS with its 1 MiB default): the bus refuses, the client gets a 413 in
    OpenAI's shape, never a 500."""
    limit = bus.nc.max_payload
    roomy = {"gateway_max_body_bytes": 2 * limit}
    worker = await client.register_worker(WorkerRegister(
        name=f"w-{uuid.uuid4().hex[:6]}", hostname="h", simulated=True,
        status=DeviceStatus(cpu_cores=4, memory_total=2**34)))
    model = await client.create_model(ModelCreate(name=f"big-{uuid.uuid4().hex[:6]}",
                                                  source="/models/x.gguf", replicas=0))
    inst = await client.create_instance(InstanceCreate(model_id=model.id))
    for state in (InstanceState.SCHEDULED, InstanceState.STARTING, InstanceState.RUNNING):
        inst = await client.transition_instance(InstanceTransition(
            id=inst.id, version=inst.version, state=state,
            placement=Placement(worker_id=worker.id) if state is InstanceState.SCHEDULED else None))
    text = "x" * (limit + 1024)
    async with running_gateway(settings.model_copy(update=roomy)) as url, \
            aiohttp.ClientSession() as http:
        for path, body in (("/v1/chat/completions",
                            {"model": model.name, "messages": [{"role": "user", "content": text}]}),
                           ("/v1/completions", {"model": model.name, "prompt": text}),
                           ("/tokenize", {"model": model.name, "prompt": text})):
            async with http.post(f"{url}{path}", json=body) as r:
                status, error = r.status, (await r.json())["error"]
            assert status == 413, (path, error)
            assert set(error) == SHAPE and error["code"] == "request_too_large"
            assert f"at most {limit} bytes" in error["message"], error


async def test_nul_characters_are_a_400_not_a_database_error(gateway: str,
                                                             http: aiohttp.ClientSession) -> None:
    """Found by the fuzzer: Postgres text cannot hold NUL, so a name or a source carrying one
    was a DBAPIError (500) in the registry; the registry refuses it first."""
    for method, path, body in (
            ("POST", "/api/v1/models", {"name": "nul", "source": "/models/x\u0000.gguf"}),
            ("POST", "/v1/embeddings", {"model": "m\u0000", "input": "hi"}),
            ("POST", "/v1/chat/completions", {**CHAT, "model": "m\u0000"}),
            ("GET", "/api/v1/models/a\u0000b", None)):
        async with http.request(method, f"{gateway}{path}", json=body) as r:
            assert r.status == 400, (path, await r.text())
            error = (await r.json())["error"]
        assert set(error) == SHAPE and "NUL" in error["message"], path


async def test_an_expiring_key_is_cached_no_longer_than_it_lives(locked: str,
                                                                 client: RegistryClient) -> None:
    """The cache would trust a key for an hour here; one that expires in 1.5 s stops at once."""
    from datetime import UTC, datetime, timedelta

    key = await client.create_key(ApiKeyCreate(
        name=f"brief-{uuid.uuid4().hex[:6]}",
        expires_at=datetime.now(UTC) + timedelta(seconds=1.5)))
    assert (await sdk(locked, key.secret).models.list()).object == "list"
    await asyncio.sleep(2.0)
    with pytest.raises(openai.AuthenticationError):
        await sdk(locked, key.secret).models.list()
