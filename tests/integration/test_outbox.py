"""Lossless events: a registry SIGKILLed between the commit of a write and the publish of its
event (a failpoint) loses nothing: the next registry publishes the event from the outbox; and a
row published twice (a relay that died before deleting it) is one message in the stream."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.errors import ShoalError
from shoal.shared.schemas.events import ModelEvent
from shoal.shared.schemas.registry import ModelCreate

from tests.integration.conftest import make_settings, running_registry
from tests.integration.test_namespaces import _second_database

pytestmark = pytest.mark.integration


async def _events_of(bus: Bus, model_id: str) -> list[ModelEvent]:
    """Every event of the model in the namespace's stream (from its start)."""
    sub = await bus.js.subscribe(bus.subjects.event("models", model_id), ordered_consumer=True)
    found = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=1.0)
            except TimeoutError:
                return found
            found.append(ModelEvent.model_validate_json(msg.data))
    finally:
        await sub.unsubscribe()


async def test_registry_killed_between_commit_and_publish_loses_no_event(
        servers, tmp_path: Path) -> None:
    settings = make_settings(servers, tmp_path,
                             database_url=await _second_database(servers.database_url))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env.update(SHOAL_NATS_URL=settings.nats_url, SHOAL_DATABASE_URL=settings.database_url,
               SHOAL_DATA_DIR=str(tmp_path), SHOAL_NAMESPACE=settings.ns,
               SHOAL_FAILPOINTS=json.dumps(["registry.after_commit"]))
    doomed = subprocess.Popen([sys.executable, "-m", "shoal", "registry"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    bus = await Bus.connect(settings, name="outbox-test")
    try:
        await bus.ensure_events_stream()
        client = RegistryClient(bus)
        name = f"m-{uuid.uuid4().hex[:8]}"
        for _ in range(100):  # until the doomed registry serves, and dies on its first commit
            try:
                await client.create_model(ModelCreate(name=name, source="/models/x", replicas=0))
                raise AssertionError("the failpoint did not kill the registry")
            except ShoalError:
                if doomed.poll() is not None:
                    break
                await asyncio.sleep(0.2)
        assert doomed.wait(10) == -9, "the registry was not SIGKILLed after its commit"

        async with running_registry(settings):  # a fresh registry on the same database
            model = await client.get_model(name=name)  # the write was committed
            for _ in range(50):
                events = await _events_of(bus, model.id)
                if events:
                    break
                await asyncio.sleep(0.1)
        assert [(e.kind.value, e.version, e.data.name) for e in events] == [("created", 1, name)]

        # a relay that published and died before deleting re-publishes under the same id
        subject = bus.subjects.event("models", model.id)
        for _ in range(2):
            await bus.js.publish(subject, events[0].model_dump_json().encode(),
                                 headers={"Nats-Msg-Id": "replayed-" + model.id})
        assert len(await _events_of(bus, model.id)) == 2  # the created event + one copy
    finally:
        if doomed.poll() is None:
            doomed.kill()
        await bus.close()
