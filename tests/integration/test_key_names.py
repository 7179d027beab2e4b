"""API keys by name (issue 24): one name means one key not revoked, and a name is taken wherever
an id is, by the registry (so the CLI and the management API agree), the `shoal keys` commands
and /api/v1/keys/{id}. Real registry (NATS + Postgres) and gateway; the CLI runs in-process."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

import aiohttp
import pytest

from shoal.cli import build_parser
from shoal.cli.commands import keys_cmd
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.errors import Conflict, NotFound
from shoal.shared.schemas.registry import ApiKeyCreate, ApiKeyScope, ApiKeyUpdate, KeyLimit
from tests.integration.test_gateway import running_gateway

pytestmark = pytest.mark.integration


def _name(prefix: str = "app") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


async def _cli(settings: Settings, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """`shoal keys ...` against this session's registry (the CLI runs its own event loop)."""
    args = build_parser().parse_args(["keys", *argv])
    assert await asyncio.to_thread(keys_cmd, settings, args) == 0
    return capsys.readouterr().out


async def test_a_second_key_with_a_name_in_use_is_refused(client: RegistryClient) -> None:
    name = _name()
    first = await client.create_key(ApiKeyCreate(name=name, scope=ApiKeyScope.ADMIN))
    with pytest.raises(Conflict) as err:
        await client.create_key(ApiKeyCreate(name=name, scope=ApiKeyScope.INFERENCE))
    assert err.value.param == "name" and err.value.code == "duplicate_name"
    assert name in err.value.message and first.id in err.value.message
    assert [k.id for k in await client.list_keys() if k.name == name] == [first.id]
    await client.revoke_key(name)  # revoked: the name is free for a new key (rotation)
    second = await client.create_key(ApiKeyCreate(name=name, scope=ApiKeyScope.INFERENCE))
    assert (await client.get_key(name)).id == second.id  # the key not revoked


async def test_names_resolve_everywhere_in_the_cli(settings: Settings, client: RegistryClient,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`shoal keys revoke NAME` said "not found" for a listed key; `keys update NAME` changed
    the first key listed under that name (in the issue, the admin key)."""
    admin, app = _name("ops"), _name("my-app")
    await client.create_key(ApiKeyCreate(name=admin, scope=ApiKeyScope.ADMIN))
    made = await client.create_key(ApiKeyCreate(name=app, scope=ApiKeyScope.INFERENCE))
    out = json.loads(await _cli(settings, capsys, "update", app, "--limit", "rpm=120", "--json"))
    assert out["id"] == made.id and out["limits"][0]["rpm"] == 120
    assert (await client.get_key(admin)).limits == []  # the other key is untouched
    out = json.loads(await _cli(settings, capsys, "usage", "--key", app, "--json"))
    assert out == []
    out = json.loads(await _cli(settings, capsys, "revoke", app, "--json"))
    assert out["id"] == made.id and out["revoked_at"] is not None
    assert (await client.get_key(made.id)).revoked_at is not None
    with pytest.raises(NotFound):
        await client.get_key(_name("nobody"))


async def test_two_revoked_keys_with_one_name_are_ambiguous(client: RegistryClient) -> None:
    """Revoked keys keep their names, so a name may mean several of them: refused with their
    ids rather than the first match."""
    name = _name("rotated")
    old = [await client.create_key(ApiKeyCreate(name=name))]
    await client.revoke_key(name)
    old.append(await client.create_key(ApiKeyCreate(name=name)))
    await client.revoke_key(old[1].id)
    with pytest.raises(Conflict) as err:
        await client.get_key(name)
    assert err.value.code == "ambiguous_name"
    assert all(k.id in err.value.message for k in old)
    with pytest.raises(Conflict):
        await client.update_key(ApiKeyUpdate(id=name, limits=[KeyLimit(rpm=1)]))


@pytest.fixture(scope="module")
async def gateway(settings: Settings, registry) -> AsyncIterator[str]:
    async with running_gateway(settings) as url:
        yield url


async def test_the_management_api_takes_a_name_where_it_takes_an_id(
        gateway: str, client: RegistryClient) -> None:
    name = _name("api")
    json_type = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{gateway}/api/v1/keys", json={"name": name}) as r:
            assert r.status == 201
            made = await r.json()
        async with http.post(f"{gateway}/api/v1/keys", json={"name": name}) as r:
            assert r.status == 409
            error = (await r.json())["error"]
        assert error["param"] == "name" and error["code"] == "duplicate_name"
        async with http.get(f"{gateway}/api/v1/keys/{name}") as r:
            assert r.status == 200 and (await r.json())["id"] == made["id"]
        async with http.patch(f"{gateway}/api/v1/keys/{name}", headers=json_type,
                              data=json.dumps({"limits": [{"rpm": 7}]})) as r:
            assert r.status == 200 and (await r.json())["limits"][0]["rpm"] == 7
        async with http.get(f"{gateway}/api/v1/usage?key_id={name}") as r:
            assert r.status == 200 and (await r.json())["items"] == []
        async with http.delete(f"{gateway}/api/v1/keys/{name}") as r:
            assert r.status == 200 and (await r.json())["id"] == made["id"]
        async with http.get(f"{gateway}/api/v1/keys/{_name('nobody')}") as r:
            assert r.status == 404


async def test_keys_create_warns_when_a_gateway_does_not_require_keys(
        gateway: str, settings: Settings, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 24: a key made for an open stack silently did nothing; `shoal keys create` now
    says that the gateway serves requests without a key (it asks every gateway on the bus)."""
    args = build_parser().parse_args(["keys", "create", _name("warned")])
    assert await asyncio.to_thread(keys_cmd, settings, args) == 0
    captured = capsys.readouterr()
    assert "created" in captured.out
    port = gateway.rsplit(":", 1)[1]
    assert "does not require API keys" in captured.err and f":{port}" in captured.err
    assert "SHOAL_REQUIRE_API_KEY=true" in captured.err
