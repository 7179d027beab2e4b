"""An engine instance's states and its serving lifecycle, whatever its engine serves.

`InstanceReporter` moves the instance through its states in the registry, each write naming the
placement this engine serves (shared/placement_fence.py). `serve_instance` is
what every loaded engine does, generation (service.py) or embeddings (embed_service.py): take
requests, publish its load and /metrics, move to RUNNING, then wait for the stop signal (SIGTERM:
drain, i.e. intake stops and in-flight requests finish, up to drain_timeout) or for the engine to
fail (ERROR with the cause, exit non-zero: the supervisor restarts it). All along it re-reads its
instance every `engine_placement_check_interval` and after every NATS reconnection: an engine
whose instance was placed anew meanwhile (its worker was cut off by a partition, and the
instance rescheduled elsewhere) is fenced: it stops taking requests and drains at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from shoal.services.engine.server.intake import Intake
from shoal.shared.placement_fence import STALE_PLACEMENT
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
    """Moves the instance through its states, re-reading on a stale version; its writes name the
    placement it was started for, so the registry refuses them once the instance moved on."""

    def __init__(self, registry: RegistryClient, instance: InstancePublic) -> None:
        self.registry = registry
        self.instance = instance
        self.worker_id = instance.worker_id
        self.generation = instance.placement_generation

    async def move(self, state: InstanceState, message: str | None = None) -> None:
        for _ in range(5):
            current = self.instance.state
            if current is not state and not can_transition(current, state):
                raise Gone(f"instance is {current.value}; cannot move to {state.value}")
            try:
                self.instance = await self.registry.transition_instance(InstanceTransition(
                    id=self.instance.id, version=self.instance.version, state=state,
                    state_message=message, placement_generation=self.generation))
                return
            except Conflict as exc:
                if exc.code == STALE_PLACEMENT:
                    raise Gone(exc.message) from None
                await self.refresh()
        raise Gone(f"could not move the instance to {state.value}: it keeps changing")

    async def refresh(self) -> None:
        try:
            self.instance = await self.registry.get_instance(self.instance.id)
        except NotFound:
            raise Gone("the instance was deleted") from None
        instance = self.instance
        if instance.worker_id != self.worker_id or instance.state is InstanceState.PENDING:
            raise Gone(f"the instance was moved to worker {instance.worker_name or 'none'}")
        if instance.placement_generation != self.generation:
            raise Gone(f"the instance was placed anew (generation {self.generation} -> "
                       f"{instance.placement_generation})")


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
    watch = asyncio.create_task(watch_placement(reporter, bus, stop,
                                                settings.engine_placement_check_interval))
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
        watch.cancel()
        load_stop.set()
        await loads
        await endpoint.stop()


async def watch_placement(reporter: InstanceReporter, bus: Bus, stop: asyncio.Event,
                          every_s: float) -> None:
    """Re-read the instance every `every_s` and after each NATS reconnection; set `stop` (drain
    and exit) once it shows this engine's placement is over. A registry that cannot answer
    fences nothing: engines serve through a registry outage."""
    wake = asyncio.Event()
    bus.on_reconnect.append(wake.set)
    try:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), every_s)
            wake.clear()
            try:
                await reporter.refresh()
            except Gone as exc:
                log.warning("fenced: %s; this engine stops taking requests and drains", exc)
                stop.set()
                return
            except ShoalError as exc:
                log.info("cannot check the placement now (%s); serving on", exc.message)
            except Exception:  # noqa: BLE001 - a bug here must not end the serving
                log.exception("the placement check failed; serving on")
    finally:
        bus.on_reconnect.remove(wake.set)


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
