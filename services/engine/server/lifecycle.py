"""An engine instance's states and its serving lifecycle, whatever its engine serves.

`InstanceReporter` moves the instance through its states in the registry. `serve_instance` is
what every loaded engine does, generation (service.py) or embeddings (embed_service.py): take
requests, publish its load and /metrics, move to RUNNING, then wait for the stop signal (SIGTERM:
drain, i.e. intake stops and in-flight requests finish, up to drain_timeout) or for the engine to
fail (ERROR with the cause, exit non-zero: the supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from shoal.services.engine.server.intake import Intake
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.errors import Conflict, NotFound, ShoalError
from shoal.shared.loops import wait_or_stop
from shoal.shared.metrics_endpoint import MetricsEndpoint
from shoal.shared.schemas.registry import InstancePublic, InstanceTransition
from shoal.shared.states import InstanceState, can_transition

log = logging.getLogger(__name__)
FAILURE_POLL_S = 0.5


class Gone(Exception):
    """The instance was deleted or moved away: this engine has nothing to serve."""


class InstanceReporter:
    """Moves the instance through its states, re-reading on a stale version."""

    def __init__(self, registry: RegistryClient, instance: InstancePublic) -> None:
        self.registry = registry
        self.instance = instance
        self.worker_id = instance.worker_id

    async def move(self, state: InstanceState, message: str | None = None) -> None:
        for _ in range(5):
            current = self.instance.state
            if current is not state and not can_transition(current, state):
                raise Gone(f"instance is {current.value}; cannot move to {state.value}")
            try:
                self.instance = await self.registry.transition_instance(InstanceTransition(
                    id=self.instance.id, version=self.instance.version, state=state,
                    state_message=message))
                return
            except Conflict:
                await self.refresh()
        raise Gone(f"could not move the instance to {state.value}: it keeps changing")

    async def refresh(self) -> None:
        try:
            self.instance = await self.registry.get_instance(self.instance.id)
        except NotFound:
            raise Gone("the instance was deleted") from None
        instance = self.instance
        if instance.worker_id != self.worker_id or instance.state is InstanceState.PENDING:
            raise Gone("the instance was moved to another worker")


async def serve_instance(settings: Settings, bus: Bus, reporter: InstanceReporter,
                         handlers: Intake, metrics: CollectorRegistry, stop: asyncio.Event,
                         failure: Callable[[], str | None]) -> None:
    """Serve `handlers` as the RUNNING instance until `stop` (then drain) or until `failure()`
    names one (then ERROR and SystemExit(1))."""
    await handlers.start()
    endpoint = MetricsEndpoint(metrics, "engine", settings, port=0, labels={
        "instance": reporter.instance.name, "model_name": handlers.model_name})
    await endpoint.start(bus)
    load_stop = asyncio.Event()
    loads = asyncio.create_task(handlers.publish_load_forever(load_stop))
    try:
        await reporter.move(InstanceState.RUNNING, None)
        log.info("serving %s as instance %s", handlers.model_name, reporter.instance.name)
        failed = await _until_stop_or_failure(failure, stop)
        if failed is not None:  # e.g. a tensor / pipeline parallel rank died: restart them all
            await report_error(reporter, f"engine failed: {failed}")
            raise SystemExit(1)
        log.info("draining (up to %.0fs)", settings.drain_timeout)
        await handlers.stop_intake()
        await handlers.wait_in_flight(settings.drain_timeout)
    except Gone as exc:
        log.info("stopping: %s", exc)
    finally:
        load_stop.set()
        await loads
        await endpoint.stop()


async def _until_stop_or_failure(failure: Callable[[], str | None],
                                 stop: asyncio.Event) -> str | None:
    """Wait for the stop signal; return the engine's failure if one comes first (the streams
    have had their errors already: the instance then goes to ERROR and the supervisor restarts
    the engine, every rank with it)."""
    while not stop.is_set():
        if (failed := failure()) is not None:
            return failed
        await wait_or_stop(stop, FAILURE_POLL_S)
    return None


async def report_error(reporter: InstanceReporter, message: str) -> None:
    try:
        await reporter.refresh()
        await reporter.move(InstanceState.ERROR, message[:2000])
    except (ShoalError, Gone):
        log.warning("could not report the error on the instance")
