"""The gateway in-process on a real port against the real registry (NATS + Postgres): ops routes,
the management API with optimistic versions, API keys, OpenAI errors for unknown models, models
with no running instance and bad input, and the bounded queue. No engine is needed here."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest

from shoal.services.gateway.service import run_gateway
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.embedded import free_port
from shoal.services.gateway.routing.infer_client import InferClient
from shoal.services.gateway.routing.instances import InstanceTable
from shoal.services.gateway.routing.router import Router
from shoal.shared.bus.client import Bus
from shoal.shared.errors import Unavailable
from shoal.shared.schemas.infer import TokenizeReply, TokenizeRequest
from shoal.shared.schemas.registry import (
    ApiKeyCreate, ApiKeyScope, DeviceStatus, InstanceCreate, InstancePublic, InstanceTransition,
    ModelCreate, ModelPublic, Placement, WorkerRegister,
)
from shoal.shared.states import InstanceState
from tests.integration.conftest import running_service

pytestmark = pytest.mark.integration


@contextlib.asynccontextmanager
async def running_gateway(settings: Settings) -> AsyncIterator[str]:
    """Run the gateway on a free port; yield its base URL."""
    settings = settings.model_copy(update={"gateway_port": free_port(None)})
    async with running_service(run_gateway, settings):
        yield f"http://127.0.0.1:{settings.gateway_port}"


@pytest.fixture(scope="module")
async def gateway(settings: Settings, registry) -> AsyncIterator[str]:
    quick = settings.model_copy(update={"gateway_engine_dead_after": 1.0})
    async with running_gateway(quick) as url:
        yield url


@pytest.fixture(scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def sdk(url: str, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


def name() -> str:
    return f"m-{uuid.uuid4().hex[:8]}"


async def test_health_version_openapi_metrics(gateway: str, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{gateway}/health") as r:
        assert r.status == 200 and (await r.json())["status"] == "ok"
    async with http.get(f"{gateway}/version") as r:
        assert r.status == 200 and (await r.json())["version"]
    async with http.get(f"{gateway}/openapi.json") as r:
        doc = await r.json()
    paths = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/api/v1/models/{id}",
             "/tokenize", "/v1/embeddings", "/v1/score", "/v1/rerank"}
    assert doc["openapi"].startswith("3.") and paths <= set(doc["paths"])
    async with http.get(f"{gateway}/metrics") as r:
        text = await r.text()
    assert r.status == 200 and "vllm:time_to_first_token_seconds" in text
    assert "shoal:gateway_requests_in_flight" in text
    assert "vllm:num_requests_running" not in text  # the engines' own, not every gateway's
    async with http.get(f"{gateway}/metrics/targets") as r:
        groups = await r.json()
    services = {g["labels"]["shoal_service"] for g in groups}
    assert r.status == 200 and {"gateway", "registry"} <= services
    registry = next(g for g in groups if g["labels"]["shoal_service"] == "registry")
    async with http.get(f"http://{registry['targets'][0]}/metrics") as r:
        assert "shoal:bus_request_duration_seconds_bucket" in await r.text()
    async with http.get(f"{gateway}/no/such/route") as r:
        assert r.status == 404 and (await r.json())["error"]["type"] == "not_found_error"


async def test_a_v1_model_entry_is_the_same_listed_or_alone(gateway: str,
                                                              http: aiohttp.ClientSession) -> None:
    """Issue 24: /v1/models/{id} lacked max_model_len and root. Both answers give vLLM's model
    card: id, object, created, owned_by, root, parent (null), max_model_len."""
    from shoal.services.engine.model_prep import smollm2_gguf_path

    model_name = name()
    async with http.post(f"{gateway}/api/v1/models", json={
            "name": model_name, "source": str(smollm2_gguf_path()), "replicas": 0,
            "device": "cpu", "max_model_len": 256}) as r:
        assert r.status == 201, await r.text()
    async with http.get(f"{gateway}/v1/models") as r:
        [listed] = [m for m in (await r.json())["data"] if m["id"] == model_name]
    async with http.get(f"{gateway}/v1/models/{model_name}") as r:
        assert r.status == 200
        alone = await r.json()
    assert alone == listed
    assert {k: alone[k] for k in ("id", "object", "owned_by", "root", "parent",
                                  "max_model_len")} == {
        "id": model_name, "object": "model", "owned_by": "shoal", "root": model_name,
        "parent": None, "max_model_len": 256}
    card = await sdk(gateway).models.retrieve(model_name)
    assert card.id == model_name and card.model_extra["max_model_len"] == 256
    async with http.get(f"{gateway}/v1/models/{name()}") as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"


async def test_an_alias_is_listed_and_reaches_its_model(gateway: str,
                                                         http: aiohttp.ClientSession) -> None:
    """vLLM's `--served-model-name a b`: b is listed (root: a) and a request for b is a request
    for a (here 503: a has no running instance), where an unknown name is a 404."""
    model_name, alias = name(), name()
    async with http.post(f"{gateway}/api/v1/models", json={
            "name": model_name, "source": "/models/x.gguf", "replicas": 0,
            "aliases": [alias]}) as r:
        assert r.status == 201, await r.text()
    async with http.get(f"{gateway}/v1/models") as r:
        cards = {m["id"]: m for m in (await r.json())["data"]}
    assert cards[alias]["root"] == cards[model_name]["root"] == model_name
    async with http.get(f"{gateway}/v1/models/{alias}") as r:
        assert (await r.json()) == cards[alias]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with http.post(f"{gateway}/v1/chat/completions", json={"model": alias, **chat}) as r:
        body = await r.json()
    assert r.status == 503 and f"`{model_name}`" in body["error"]["message"], body
    async with http.post(f"{gateway}/v1/chat/completions", json={"model": name(), **chat}) as r:
        assert r.status == 404
    async with http.post(f"{gateway}/api/v1/models", json={
            "name": name(), "source": "/models/x.gguf", "replicas": 0,
            "aliases": [alias]}) as r:
        assert r.status == 409 and (await r.json())["error"]["param"] == "aliases"


async def test_management_models_crud_with_stale_version(gateway: str,
                                                         http: aiohttp.ClientSession) -> None:
    model_name = name()
    async with http.post(f"{gateway}/api/v1/models",
                         json={"name": model_name, "source": "/models/x.gguf",
                                                             "replicas": 0}) as r:
        assert r.status == 201, await r.text()
        created = await r.json()
    async with http.get(f"{gateway}/api/v1/models/{model_name}") as r:
        assert (await r.json())["id"] == created["id"]
    async with http.get(f"{gateway}/api/v1/models") as r:
        assert model_name in [m["name"] for m in (await r.json())["items"]]
    async with http.patch(f"{gateway}/api/v1/models/{created['id']}",
                          json={"version": created["version"], "replicas": 0,
                                "max_model_len": 256}) as r:
        assert r.status == 200, await r.text()
        updated = await r.json()
    assert updated["version"] > created["version"] and updated["max_model_len"] == 256
    async with http.patch(f"{gateway}/api/v1/models/{created['id']}",
                          json={"version": created["version"], "max_model_len": 128}) as r:
        assert r.status == 409 and (await r.json())["error"]["type"] == "conflict_error"
    async with http.patch(f"{gateway}/api/v1/models/{created['id']}", json={"version": "x"}) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "version"
    async with http.post(f"{gateway}/api/v1/models",
                         json={"name": "bad name!", "source": "x"}) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "name"
    model_url = f"{gateway}/api/v1/models/{created['id']}"
    async with http.delete(f"{model_url}?version={created['version']}") as r:
        assert r.status == 409
    async with http.delete(f"{model_url}?version={updated['version']}") as r:
        assert r.status == 200
    async with http.get(f"{gateway}/api/v1/models/{model_name}") as r:
        assert r.status == 404
    for resource in ("instances", "workers", "keys"):
        async with http.get(f"{gateway}/api/v1/{resource}") as r:
            assert r.status == 200 and "items" in await r.json()
    async with http.get(f"{gateway}/api/v1/instances?state=bogus") as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "state"


async def test_unknown_model_is_404_and_no_instance_is_503(gateway: str,
                                                           client: RegistryClient) -> None:
    api = sdk(gateway)
    with pytest.raises(openai.NotFoundError) as err:
        await api.chat.completions.create(model="no-such-model",
                                          messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["code"] == "model_not_found"
    model = await client.create_model(ModelCreate(name=name(), source="/models/x.gguf", replicas=0))
    with pytest.raises(openai.APIStatusError) as err:
        await api.completions.create(model=model.name, prompt="hi")
    assert err.value.status_code == 503
    with pytest.raises(openai.APIStatusError) as err:
        stream = await api.chat.completions.create(model=model.name, stream=True,
                                                   messages=[{"role": "user", "content": "hi"}])
        async for _ in stream:
            pass
    assert err.value.status_code == 503
    listed = await api.models.list()
    assert model.name in [m.id for m in listed.data]


async def running_without_engine(client: RegistryClient) -> tuple[ModelPublic, InstancePublic]:
    """A model with one instance RUNNING in the registry on a simulated worker, no engine."""
    worker = await client.register_worker(WorkerRegister(
        name=f"w-{uuid.uuid4().hex[:6]}", hostname="h", simulated=True,
        status=DeviceStatus(cpu_cores=4, memory_total=2**34)))
    model = await client.create_model(ModelCreate(name=name(), source="/models/x.gguf", replicas=0))
    inst = await client.create_instance(InstanceCreate(model_id=model.id))
    for state in (InstanceState.SCHEDULED, InstanceState.STARTING, InstanceState.RUNNING):
        inst = await client.transition_instance(InstanceTransition(
            id=inst.id, version=inst.version, state=state,
            placement=Placement(worker_id=worker.id) if state is InstanceState.SCHEDULED else None))
    return model, inst


async def test_running_instance_without_engine_fails_fast(gateway: str,
                                                          client: RegistryClient) -> None:
    """A RUNNING row whose engine is gone: no responders, so 503 at once, never a hang. Sent
    as soon as the registry says RUNNING: the gateway routes to it, event or not."""
    model, _ = await running_without_engine(client)
    api = sdk(gateway)
    with pytest.raises(openai.APIStatusError) as err:
        await asyncio.wait_for(api.completions.create(model=model.name, prompt="hi"), 15)
    assert err.value.status_code == 503 and "no engine listens" in err.value.message
    await asyncio.sleep(1.5)  # no load for gateway_engine_dead_after (1 s): routed around as dead
    with pytest.raises(openai.APIStatusError) as err:
        await asyncio.wait_for(api.completions.create(model=model.name, prompt="hi"), 15)
    assert err.value.status_code == 503 and "no running instance" in err.value.message


async def test_running_in_the_registry_is_routed_before_its_event(settings: Settings, bus: Bus,
                                                                  client: RegistryClient) -> None:
    """The gateway's instance table hears RUNNING from the registry's event a moment after the
    commit that a client may already have seen; with no instance of the model in the table,
    the gateway asks the registry before it answers 503. This table never hears an event."""
    table = InstanceTable(bus, client, settings, Router())
    infer = InferClient(bus, client, table, table.router, settings)
    model, inst = await running_without_engine(client)
    with pytest.raises(Unavailable) as err:
        await infer.call(model.name, TokenizeRequest(model=model.name, prompt="hi"),
                         TokenizeReply, timeout=5)
    assert "no running instance" not in err.value.message, err.value.message
    assert [c.instance_id for c in table.candidates(model.name)] == [inst.id]


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
     "max_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
     "temperature"),
    ({"model": "m", "messages": "hi"}, "messages"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3},
     "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
])
async def test_bad_chat_requests_are_400(gateway: str, http: aiohttp.ClientSession, body: dict,
                                         param: str) -> None:
    async with http.post(f"{gateway}/v1/chat/completions", json=body) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


async def test_malformed_json_and_bad_completions_are_400(gateway: str,
                                                          http: aiohttp.ClientSession) -> None:
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/api/v1/models"):
        async with http.post(f"{gateway}{path}", data=b"{not json",
                             headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400, path
            assert (await r.json())["error"]["type"] == "invalid_request_error"
    async with http.post(f"{gateway}/v1/completions", data=b"[1, 2]") as r:
        assert r.status == 400
    api = sdk(gateway)
    with pytest.raises(openai.BadRequestError) as err:
        await api.completions.create(model="m", prompt="hi", logprobs=50)
    assert err.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError):
        await api.completions.create(model="m", prompt=[], max_tokens=3)
    async with http.get(f"{gateway}/v1/chat/completions") as r:
        assert r.status == 405 and "error" in await r.json()


async def test_bounded_queue_answers_429(settings: Settings, registry) -> None:
    async with running_gateway(settings.model_copy(update={"gateway_max_outstanding": 0})) as url:
        with pytest.raises(openai.RateLimitError) as err:
            await sdk(url).chat.completions.create(model="m",
                                                   messages=[{"role": "user", "content": "hi"}])
        assert err.value.response.headers.get("retry-after") == "1"


async def test_api_keys_when_required(settings: Settings, registry, client: RegistryClient,
                                      http: aiohttp.ClientSession) -> None:
    locked = settings.model_copy(update={"require_api_key": True, "gateway_key_cache_ttl": 0.2})
    async with running_gateway(locked) as url:
        async with http.get(f"{url}/health") as r:
            assert r.status == 200
        with pytest.raises(openai.AuthenticationError):
            await sdk(url, "sk-wrong").models.list()
        async with http.get(f"{url}/v1/models") as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        key = await client.create_key(ApiKeyCreate(name=name(), scope=ApiKeyScope.ADMIN))
        assert (await sdk(url, key.secret).models.list()).object == "list"
        async with http.get(f"{url}/api/v1/workers",
                            headers={"Authorization": f"Bearer {key.secret}"}) as r:
            assert r.status == 200
        await client.revoke_key(key.id)
        await asyncio.sleep(0.3)
        with pytest.raises(openai.AuthenticationError):
            await sdk(url, key.secret).models.list()
