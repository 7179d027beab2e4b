"""The registry service: the only writer to Postgres, serving shoal.registry.* over NATS micro."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from shoal.services.registry.api import RegistryApi
from shoal.services.registry.liveness import Liveness
from shoal.services.registry.repo.api_keys import ApiKeyRepo
from shoal.services.registry.repo.quota import QuotaRepo
from shoal.services.registry.repo.instances import InstanceRepo
from shoal.services.registry.repo.models import ModelRepo
from shoal.services.registry.repo.workers import WorkerRepo
from shoal.shared.bus.client import Bus
from shoal.shared.bus.service import RpcService
from shoal.shared.config import Settings
from shoal.shared.metrics import new_registry
from shoal.shared.metrics_endpoint import MetricsEndpoint
from shoal.shared.db.session import (
    make_engine, make_session_factory, run_migrations, wait_for_database,
)
from shoal.shared.embedded import redact_url
from shoal.shared.errors import Unavailable
from shoal.shared.schemas.registry import WorkerHeartbeat
from shoal.shared.version import VERSION

log = logging.getLogger(__name__)


async def run_registry(settings: Settings, stop: asyncio.Event,
                       ready: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set; `ready` is set once every endpoint is subscribed."""
    if not settings.database_url:
        raise Unavailable("no database URL: set SHOAL_DATABASE_URL or start the stack with "
                          "`shoal up`")
    engine = make_engine(settings.database_url)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(engine.dispose)
        await wait_for_database(engine, settings.database_wait)
        await run_migrations(engine)
        sessions = make_session_factory(engine)
        bus = await Bus.connect(settings, name="shoal-registry")
        stack.push_async_callback(bus.close)
        await bus.ensure_events_stream()

        api = RegistryApi(bus, sessions, ModelRepo(sessions), WorkerRepo(sessions),
                          InstanceRepo(sessions), ApiKeyRepo(sessions), QuotaRepo(sessions),
                          failpoints=frozenset(settings.failpoints))
        relay = asyncio.create_task(api.relay.run(stop), name="event-relay")
        metrics = new_registry()
        svc = RpcService(bus, "shoal-registry", VERSION, bus.subjects.registry_group,
                         "Shoal registry: models, workers, instances, API keys", metrics,
                         translate=api.translate)
        await svc.start()
        stack.push_async_callback(svc.stop)
        await api.register(svc)
        endpoint = MetricsEndpoint(metrics, "registry", settings)
        await endpoint.start(bus)
        stack.push_async_callback(endpoint.stop)

        liveness = Liveness(api, settings.heartbeat_timeout, settings.heartbeat_check_interval)
        await bus.subscribe(bus.subjects.heartbeats_all, WorkerHeartbeat, liveness.on_heartbeat,
                            queue=bus.subjects.registry_service)
        monitor = asyncio.create_task(liveness.run(stop), name="liveness")
        await bus.nc.flush()
        log.info("registry serving on %s.* (NATS %s)", bus.subjects.registry_group,
                 redact_url(settings.nats_url or ""))
        if ready is not None:
            ready.set()
        await stop.wait()
        await monitor
        await relay
