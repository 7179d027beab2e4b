"""Two Shoal stacks on one NATS server, each with its own namespace (derived from its data dir)
and database, never answer each other: registry requests, queue groups, events and worker
heartbeats stay within their namespace."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from pathlib import Path

import asyncpg
import pytest

from shoal.services.worker.agent import run_worker
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.errors import NotFound
from shoal.shared.schemas.registry import ModelCreate

from tests.integration.conftest import make_settings, running_registry

pytestmark = pytest.mark.integration


async def _second_database(url: str) -> str:
    """A fresh database beside the session's (whose scheduler tests must not see these rows)."""
    name = f"shoal_ns_{uuid.uuid4().hex[:10]}"
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    base, _, query = url.partition("?")
    base = base.rsplit("/", 1)[0] + "/" + name
    return f"{base}?{query}" if query else base


async def test_two_stacks_on_one_nats_do_not_answer_each_other(servers, tmp_path: Path) -> None:
    one = make_settings(servers, tmp_path / "one",
                        database_url=await _second_database(servers.database_url))
    two = make_settings(servers, tmp_path / "two",
                        database_url=await _second_database(servers.database_url))
    assert one.ns != two.ns  # the default comes from the data dir
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(running_registry(one))
        await stack.enter_async_context(running_registry(two))
        bus_one = await Bus.connect(one, name="ns-one")
        stack.push_async_callback(bus_one.close)
        bus_two = await Bus.connect(two, name="ns-two")
        stack.push_async_callback(bus_two.close)
        a, b = RegistryClient(bus_one), RegistryClient(bus_two)

        seen_by_two: list[str] = []

        async def on_event(msg) -> None:  # noqa: ANN001
            seen_by_two.append(msg.subject)

        sub = await bus_two.nc.subscribe(bus_two.subjects.events_all, cb=on_event)
        stack.push_async_callback(sub.unsubscribe)

        # With shared subjects and queue groups, each request would reach either registry:
        # 8 creates all landing in stack one's database would then be a 1-in-256 chance.
        names = [f"m-{uuid.uuid4().hex[:8]}" for _ in range(8)]
        for name in names:
            await a.create_model(ModelCreate(name=name, source="/models/x", replicas=0))
        assert {m.name for m in await a.list_models()} >= set(names)
        assert not {m.name for m in await b.list_models()} & set(names)
        with pytest.raises(NotFound):
            await b.get_model(name=names[0])
        # the same name in the other stack is another model
        other = await b.create_model(ModelCreate(name=names[0], source="/models/y", replicas=0))
        assert (await a.get_model(name=names[0])).source == "/models/x" != other.source

        # a worker of stack one heartbeats and registers in stack one only
        stop, ready = asyncio.Event(), asyncio.Event()
        worker = asyncio.create_task(run_worker(one.model_copy(update={
            "worker_name": "ns-sim", "simulate_devices": "1xA10-24GB"}), stop, ready))
        try:
            await asyncio.wait_for(ready.wait(), 10)
            assert "ns-sim" in {w.name for w in await a.list_workers()}
            assert "ns-sim" not in {w.name for w in await b.list_workers()}
        finally:
            stop.set()
            await worker
        await asyncio.sleep(0.3)
        # stack two saw only its own event (the one create), none of stack one's
        assert seen_by_two and all(s.startswith(f"shoal.{two.ns}.") for s in seen_by_two)
        assert len(seen_by_two) == 1, seen_by_two
