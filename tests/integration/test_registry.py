"""The registry over real NATS + Postgres: CRUD, optimistic versions, the state machine,
events, API keys, malformed messages, restarts."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

import asyncpg
import pytest

from shoal.shared.bus.codec import ERROR_CODE_HEADER
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.errors import Conflict, InvalidRequest, NotFound
from shoal.shared.schemas.events import ModelEvent
from shoal.shared.schemas.registry import (
    DeleteRequest, InstanceCreate, InstanceFilter, InstanceTransition, ModelCreate, ModelUpdate,
    Placement,
    ResourceClaim, WorkerRegister, DeviceStatus, GpuDevice, ApiKeyCreate,
)
from shoal.shared.states import InstanceState

pytestmark = pytest.mark.integration


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def new_model(client: RegistryClient, **spec: object) -> object:
    return await client.create_model(ModelCreate(name=unique("m"), source="/models/x", **spec))


async def test_model_crud(client: RegistryClient) -> None:
    model = await new_model(client, replicas=2)
    assert model.version == 1 and model.replicas == 2
    assert (await client.get_model(name=model.name)).id == model.id
    assert model.id in {m.id for m in await client.list_models()}
    updated = await client.update_model(ModelUpdate(id=model.id, version=1, replicas=3))
    assert (updated.replicas, updated.version) == (3, 2)
    await client.delete_model(DeleteRequest(id=model.id))
    with pytest.raises(NotFound):
        await client.get_model(id=model.id)


async def test_an_update_of_how_it_runs_bumps_the_run_revision(client: RegistryClient) -> None:
    """The scheduler rolls the instances made for an older run revision (reconcile.roll): an
    update of engine_args or a backend field bumps it, replicas or the same value again do not,
    and a new instance carries the model's."""
    model = await new_model(client, backend="vllm")
    assert model.run_revision == 0
    more = await client.update_model(ModelUpdate(id=model.id, version=model.version, replicas=2))
    assert more.run_revision == 0
    old = await client.create_instance(InstanceCreate(model_id=model.id))
    env = await client.update_model(ModelUpdate(id=model.id, version=more.version,
                                                env={"A": "1"}))
    assert env.run_revision == 1
    same = await client.update_model(ModelUpdate(id=model.id, version=env.version,
                                                 env={"A": "1"}))
    assert same.run_revision == 1
    flags = await client.update_model(ModelUpdate(id=model.id, version=same.version,
                                                  backend_parameters=["--enforce-eager"],
                                                  engine_args={"max_num_seqs": 4}))
    assert flags.run_revision == 2
    new = await client.create_instance(InstanceCreate(model_id=model.id))
    assert (old.run_revision, new.run_revision) == (0, 2)
    await client.delete_model(DeleteRequest(id=model.id))


async def test_duplicate_model_name_is_a_conflict(client: RegistryClient) -> None:
    model = await new_model(client)
    with pytest.raises(Conflict):
        await client.create_model(ModelCreate(name=model.name, source="/elsewhere"))


async def test_a_name_reaches_one_model_aliases_included(client: RegistryClient) -> None:
    """vLLM's `--served-model-name a b`: b is an alias of a. No alias may be another model's
    name or alias (409 naming the field), also when two creates race for it."""
    first = await new_model(client, aliases=[unique("alias")])
    alias = first.aliases[0]
    with pytest.raises(Conflict) as err:
        await new_model(client, aliases=[unique("other"), alias])
    assert err.value.param == "aliases" and first.name in err.value.message
    with pytest.raises(Conflict) as err:
        await client.create_model(ModelCreate(name=alias, source="/models/x"))
    assert err.value.param == "name"
    with pytest.raises(Conflict):
        await new_model(client, aliases=[first.name])
    second = await new_model(client)
    with pytest.raises(Conflict):
        await client.update_model(ModelUpdate(id=second.id, version=second.version,
                                              aliases=[alias]))
    with pytest.raises(InvalidRequest) as err:
        await client.update_model(ModelUpdate(id=second.id, version=second.version,
                                              aliases=[second.name]))
    assert err.value.param == "aliases"
    renamed = await client.update_model(ModelUpdate(id=first.id, version=first.version,
                                                    aliases=[unique("new")]))
    moved = await client.update_model(ModelUpdate(id=second.id, version=second.version,
                                                  aliases=[alias]))  # free again
    assert moved.aliases == [alias] and renamed.aliases != [alias]
    racing = unique("race")
    results = await asyncio.gather(*(new_model(client, aliases=[racing]) for _ in range(4)),
                                   return_exceptions=True)
    assert sum(not isinstance(r, BaseException) for r in results) == 1
    assert all(isinstance(r, Conflict) for r in results if isinstance(r, BaseException))


async def test_concurrent_updates_one_wins_nothing_lost(client: RegistryClient) -> None:
    model = await new_model(client, replicas=1)
    results = await asyncio.gather(
        client.update_model(ModelUpdate(id=model.id, version=model.version, replicas=5)),
        client.update_model(ModelUpdate(id=model.id, version=model.version, replicas=7)),
        return_exceptions=True,
    )
    wins = [r for r in results if not isinstance(r, Exception)]
    losses = [r for r in results if isinstance(r, Exception)]
    assert len(wins) == 1 and len(losses) == 1, results
    assert isinstance(losses[0], Conflict)
    final = await client.get_model(id=model.id)
    assert final.version == 2 and final.replicas == wins[0].replicas
    # the loser re-reads and retries: its change lands on top, nothing is lost
    retried = await client.update_model(ModelUpdate(id=model.id, version=final.version, replicas=9))
    assert (retried.replicas, retried.version) == (9, 3)


async def test_stale_version_refused_and_nothing_written(client: RegistryClient) -> None:
    model = await new_model(client, replicas=1)
    await client.update_model(ModelUpdate(id=model.id, version=1, replicas=2))
    with pytest.raises(Conflict) as err:
        await client.update_model(ModelUpdate(id=model.id, version=1, replicas=4))
    assert err.value.code == "stale_version"
    assert (await client.get_model(id=model.id)).replicas == 2


async def register_worker(client: RegistryClient, gpus: int = 1) -> object:
    return await client.register_worker(WorkerRegister(
        name=unique("w"), hostname="test",
        status=DeviceStatus(cpu_cores=4, memory_total=2**34, gpus=[
            GpuDevice(index=i, name="A10", memory_total=24 * 2**30) for i in range(gpus)])))


async def test_instance_state_machine(client: RegistryClient) -> None:
    model = await new_model(client)
    worker = await register_worker(client)
    inst = await client.create_instance(InstanceCreate(model_id=model.id))
    assert inst.state is InstanceState.PENDING and inst.name.startswith(model.name)

    # illegal: PENDING -> RUNNING is refused and nothing is written
    with pytest.raises(Conflict) as err:
        await client.transition_instance(InstanceTransition(id=inst.id, version=inst.version,
                                                            state=InstanceState.RUNNING))
    assert err.value.code == "illegal_transition"
    same = await client.get_instance(inst.id)
    assert (same.state, same.version) == (InstanceState.PENDING, inst.version)

    # SCHEDULED needs a placement
    with pytest.raises(InvalidRequest):
        await client.transition_instance(InstanceTransition(id=inst.id, version=inst.version,
                                                            state=InstanceState.SCHEDULED))
    placement = Placement(worker_id=worker.id, gpu_indexes=[0],
                          claim=ResourceClaim(gpu_memory={0: 2**30}))
    inst = await client.transition_instance(InstanceTransition(
        id=inst.id, version=inst.version, state=InstanceState.SCHEDULED, placement=placement))
    assert (inst.worker_id, inst.gpu_indexes, inst.claim.gpu_memory) == (worker.id, [0], {0: 2**30})
    assert inst.version == same.version + 1, "one transition is one versioned write"

    # a stale version is refused even for a legal move
    with pytest.raises(Conflict):
        await client.transition_instance(InstanceTransition(id=inst.id, version=inst.version - 1,
                                                            state=InstanceState.DOWNLOADING))
    for state in (InstanceState.DOWNLOADING, InstanceState.STARTING, InstanceState.RUNNING):
        inst = await client.transition_instance(InstanceTransition(
            id=inst.id, version=inst.version, state=state, state_message=f"now {state.value}"))
    assert inst.state is InstanceState.RUNNING and inst.state_message == "now RUNNING"
    # back to PENDING clears the placement
    inst = await client.transition_instance(InstanceTransition(id=inst.id, version=inst.version,
                                                               state=InstanceState.PENDING))
    assert inst.worker_id is None and inst.gpu_indexes == []
    # same state: only the message changes
    inst = await client.transition_instance(InstanceTransition(
        id=inst.id, version=inst.version, state=InstanceState.PENDING, state_message="no GPU fits"))
    assert inst.state_message == "no GPU fits"
    listed = await client.list_instances(InstanceFilter(model_id=model.id))
    assert [i.id for i in listed] == [inst.id]


async def test_events_carry_state_and_version(bus, client: RegistryClient) -> None:
    received: asyncio.Queue[ModelEvent] = asyncio.Queue()

    async def on_event(msg) -> None:
        await received.put(ModelEvent.model_validate_json(msg.data))

    sub = await bus.nc.subscribe(bus.subjects.events_of("models"), cb=on_event)
    try:
        model = await new_model(client)
        await client.update_model(ModelUpdate(id=model.id, version=1, replicas=4))
        mine: list[ModelEvent] = []
        while len(mine) < 2:  # other tests may publish model events meanwhile
            event = await asyncio.wait_for(received.get(), 5)
            if event.id == model.id:
                mine.append(event)
    finally:
        await sub.unsubscribe()
    assert [(e.kind.value, e.version, e.data.replicas) for e in mine] == [("created", 1, 1),
                                                                          ("updated", 2, 4)]
    # and they are in the JetStream stream
    info = await bus.js.stream_info(bus.subjects.events_stream)
    assert info.state.messages >= 2


async def test_malformed_messages_get_errors_and_service_keeps_serving(
        bus, client: RegistryClient) -> None:
    subject = bus.subjects.registry("models", "create")
    for bad in (b"not json", b'{"name": 5}',
                json.dumps({"name": "ok", "source": "/x", "bogus": 1}).encode()):
        reply = await bus.nc.request(subject, bad, timeout=5)
        assert reply.headers[ERROR_CODE_HEADER] == "400"
        body = json.loads(reply.data)
        assert body["error"]["type"] == "invalid_request_error"
    assert (await new_model(client)).version == 1


async def test_discovery_ping(bus) -> None:
    name = bus.subjects.registry_service
    reply = await bus.nc.request(f"$SRV.PING.{name}", b"", timeout=5)
    assert json.loads(reply.data)["name"] == name
    info = json.loads((await bus.nc.request(f"$SRV.INFO.{name}", b"", timeout=5)).data)
    assert bus.subjects.registry("models", "create") in {e["subject"] for e in info["endpoints"]}


async def test_api_key_secret_never_stored_or_logged(client: RegistryClient, settings,
                                                     caplog) -> None:
    caplog.set_level(logging.DEBUG)
    created = await client.create_key(ApiKeyCreate(name=unique("k")))
    assert created.secret.startswith("sk-shoal-") and len(created.secret) > 40
    assert (await client.verify_key(created.secret)).valid
    assert not (await client.verify_key(created.secret + "x")).valid
    listed = {k.id: k for k in await client.list_keys()}
    assert "secret" not in listed[created.id].model_dump()
    # the database holds no trace of the secret
    conn = await asyncpg.connect(settings.database_url.replace("postgresql+asyncpg://",
                                                               "postgresql://"))
    try:
        rows = await conn.fetch("SELECT row_to_json(k)::text AS r FROM api_keys k")
    finally:
        await conn.close()
    assert rows and all(created.secret not in r["r"] for r in rows)
    assert created.secret not in caplog.text
    await client.revoke_key(created.id)
    assert not (await client.verify_key(created.secret)).valid
    with pytest.raises(Conflict):
        await client.revoke_key(created.id)


async def test_registry_restart_keeps_state(registry, client: RegistryClient) -> None:
    model = await new_model(client, replicas=3)
    inst = await client.create_instance(InstanceCreate(model_id=model.id))
    await registry.restart()
    again = await client.get_model(id=model.id)
    assert (again.name, again.replicas, again.version) == (model.name, 3, 1)
    assert (await client.get_instance(inst.id)).state is InstanceState.PENDING
