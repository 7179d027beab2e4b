"""The worker agent: registers this machine's devices, heartbeats, and (on a real worker) runs
the engines of the instances placed on it through the Supervisor. No torch import here: engines
are other processes. An agent that stops cleanly tells the registry it is leaving
(`workers.leave`), so its worker is NOT_READY at once rather than when its heartbeats time out.

A simulated worker (`--simulate-devices`) registers and heartbeats like a real one but never
starts an engine; it is marked `simulated` wherever it is shown.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from dataclasses import dataclass, field

from shoal.services.worker.devices import detect_devices, parse_simulated
from shoal.services.worker.metrics import DeviceCollector
from shoal.services.worker.engines import EngineProcess, running_engines
from shoal.services.worker.supervisor import Supervisor
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.errors import NotFound, ShoalError
from shoal.shared.loops import run_every
from shoal.shared.metrics import new_registry
from shoal.shared.metrics_endpoint import MetricsEndpoint
from shoal.shared.schemas.registry import (
    DeviceStatus, WorkerHeartbeat, WorkerLeave, WorkerPublic, WorkerRegister
)

log = logging.getLogger(__name__)
VERIFY_EVERY = 4
"""Every Nth heartbeat, check the registry still knows us (it may have lost its database)."""


@dataclass
class WorkerAgent:
    settings: Settings
    bus: Bus
    name: str = field(default="")
    worker: WorkerPublic | None = None
    supervisor: Supervisor | None = None
    """Runs the engines of the instances placed here (real workers only)."""
    last_status: DeviceStatus | None = None
    """The devices as last detected (heartbeats), for /metrics."""
    adopted: dict[str, EngineProcess] = field(default_factory=dict)
    """Engines a previous agent of this worker left running: reported at registration (the
    registry leaves their instances as they are) and handed to the Supervisor."""

    def __post_init__(self) -> None:
        self.name = self.name or self.settings.worker_name or socket.gethostname()
        self.registry = RegistryClient(self.bus)

    @property
    def simulated(self) -> bool:
        return self.settings.simulate_devices is not None

    def devices(self) -> DeviceStatus:
        if self.settings.simulate_devices is not None:
            status = parse_simulated(self.settings.simulate_devices)
        else:
            status = detect_devices()
            if self.settings.worker_cpus:
                status.cpu_cores = len(self.settings.worker_cpus)
        self.last_status = status
        return status

    async def register(self) -> WorkerPublic:
        if not self.simulated:
            self.adopted = running_engines(self.settings.data_dir, self.name)
        self.worker = await self.registry.register_worker(WorkerRegister(
            name=self.name, hostname=socket.gethostname(), labels=self.settings.worker_labels,
            simulated=self.simulated, status=self.devices(), running=sorted(self.adopted),
        ))
        log.info("registered worker %s (%s)%s", self.worker.name, self.worker.id,
                 " [simulated]" if self.simulated else "")
        return self.worker

    async def heartbeat(self) -> None:
        assert self.worker is not None
        instances = self.supervisor.instance_states() if self.supervisor is not None else {}
        await self.bus.publish(self.bus.subjects.heartbeat(self.worker.id), WorkerHeartbeat(
            worker_id=self.worker.id, status=self.devices(), instances=instances))

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        await self._register_until_done(stop)
        supervisor: asyncio.Task[None] | None = None
        if not self.simulated and self.worker is not None:
            self.supervisor = Supervisor(self.settings, self.bus, self.worker.id)
            self.supervisor.adopt(self.adopted, self.name)
            supervisor = asyncio.create_task(self.supervisor.run(stop), name="supervisor")
        metrics = new_registry()
        metrics.register(DeviceCollector(self.name, lambda: self.last_status))
        endpoint = MetricsEndpoint(metrics, "worker", self.settings, labels={"worker": self.name})
        await endpoint.start(self.bus)
        if ready is not None:
            ready.set()
        try:
            await self._heartbeat_forever(stop)
        finally:
            await endpoint.stop()
            if supervisor is not None:
                await supervisor
        await self._leave()

    async def _leave(self) -> None:
        """A clean stop (its engines drained, or left running): tell the registry, so the worker
        is NOT_READY and its instances UNREACHABLE now, not once its heartbeats time out. Those
        whose engines were left running stay as they are, for the next agent to adopt."""
        if self.worker is None:
            return
        kept = self.supervisor.kept if self.supervisor is not None else []
        try:
            await self.registry.leave_worker(WorkerLeave(id=self.worker.id, running=kept))
        except ShoalError as exc:  # the registry is away too: its heartbeat timeout will do
            log.warning("could not tell the registry this worker is leaving: %s", exc.message)
            return
        log.info("told the registry worker %s is leaving", self.name)

    async def _heartbeat_forever(self, stop: asyncio.Event) -> None:
        beats = itertools.count(1)

        async def beat() -> None:
            await self.heartbeat()
            if next(beats) % VERIFY_EVERY == 0:
                await self._verify_registration()

        await run_every(self.settings.heartbeat_interval, stop, beat, "heartbeat", log)

    async def _register_until_done(self, stop: asyncio.Event) -> None:
        delay = 0.2
        while not stop.is_set():
            try:
                await self.register()
                return
            except ShoalError as exc:
                # INFO while the registry may still be starting, WARNING after that
                level = logging.INFO if delay < 2 else logging.WARNING
                log.log(level, "cannot register yet (%s); retrying in %.1fs", exc.message, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _verify_registration(self) -> None:
        assert self.worker is not None
        try:
            await self.registry.get_worker(self.worker.id)
        except NotFound:
            log.warning("the registry no longer knows this worker: registering again")
            await self.register()


async def run_worker(settings: Settings, stop: asyncio.Event,
                     ready: asyncio.Event | None = None) -> None:
    bus = await Bus.connect(settings,
                            name=f"shoal-worker-{settings.worker_name or socket.gethostname()}")
    try:
        await WorkerAgent(settings, bus).run(stop, ready)
    finally:
        await bus.close()
