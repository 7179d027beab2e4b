"""A Postgres outage under a registry that is busy (heartbeats, liveness checks, the event relay,
bus requests): every request is a 503 (`database_unavailable`), and the log holds a few lines
(one per failure kind, no traceback), then one line when the database is back. The registry
runs on its own embedded Postgres, SIGKILLed mid-test and started again on the same files."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import uuid
from pathlib import Path

import pytest

from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.embedded import EmbeddedPostgres
from shoal.shared.errors import Unavailable
from shoal.shared.schemas.registry import DeviceStatus, WorkerHeartbeat, WorkerRegister
from tests.integration.conftest import make_settings, running_registry
from tests.integration.sched_helpers import wait_for

pytestmark = pytest.mark.integration
DOWN = "the database is unavailable: "
BACK = "the database is back after"


def _registry_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith(("shoal.services.registry",
                                                            "shoal.shared.bus"))]


async def test_a_postgres_outage_is_a_503_and_a_few_log_lines(
        servers, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    pg = await asyncio.to_thread(EmbeddedPostgres.start, tmp_path / "pg" / "data")
    settings = make_settings(servers, tmp_path / "data", database_url=pg.url,
                             namespace=f"po{uuid.uuid4().hex[:8]}")
    try:
        async with running_registry(settings):
            bus = await Bus.connect(settings, name="outage-test")
            try:
                client = RegistryClient(bus)
                status = DeviceStatus(cpu_cores=2, memory_total=2**30)
                worker = await client.register_worker(WorkerRegister(
                    name="outage", hostname="h", simulated=True, status=status))
                caplog.clear()
                os.kill(pg.process.pid, signal.SIGKILL)  # the outage
                await asyncio.to_thread(pg.process.wait)
                for _ in range(5):
                    with pytest.raises(Unavailable) as refused:
                        await client.list_models()
                    assert refused.value.code == "database_unavailable"
                    assert refused.value.http_status == 503
                    for _ in range(10):  # a heartbeat storm
                        await bus.publish(bus.subjects.heartbeat(worker.id),
                                          WorkerHeartbeat(worker_id=worker.id, status=status))
                    await bus.nc.flush()

                await asyncio.to_thread(pg.restart)

                async def answers() -> bool:
                    try:
                        await client.list_models()
                    except Unavailable:
                        return False
                    return True

                await wait_for(answers, 30, "the registry to answer again")
                before = (await client.get_worker(worker.id)).last_heartbeat_at

                async def storm_handled() -> bool:  # heartbeats are handled in order
                    await bus.publish(bus.subjects.heartbeat(worker.id),
                                      WorkerHeartbeat(worker_id=worker.id, status=status))
                    await asyncio.sleep(0.2)
                    return (await client.get_worker(worker.id)).last_heartbeat_at != before

                await wait_for(storm_handled, 30, "the heartbeats sent in the outage handled")
            finally:
                await bus.close()
    finally:
        pg.stop()
    records = _registry_records(caplog)
    assert [r for r in records if r.exc_info] == []  # no traceback
    down = [r.getMessage() for r in records if DOWN in r.getMessage()]
    kinds = [line.removeprefix(DOWN).split(":", 1)[0] for line in down]
    assert down and len(kinds) == len(set(kinds)), down  # one line per kind (all within 30 s)
    assert len([r for r in records if BACK in r.getMessage()]) == 1
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING
            and DOWN not in r.getMessage()] == []
