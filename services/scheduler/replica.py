"""One scheduler process: its bus, its status endpoint, the leader election and the service.

Every replica connects, registers the shoal-scheduler micro service (so `$SRV.PING`,
shoal.scheduler.leader.get and the dry run shoal.scheduler.placement.plan answer from standbys
too) and campaigns for the lock; only the leader reconciles. On stop the service ends its term
first, then the lock is released.
"""

from __future__ import annotations

import asyncio
import contextlib

from shoal.services.scheduler.dry_run import plan_dry_run
from shoal.services.scheduler.election import PostgresElection, default_identity
from shoal.services.scheduler.metrics import SchedulerCollector
from shoal.services.scheduler.reconcile import SchedulerConfig
from shoal.services.scheduler.service import SchedulerService
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.bus.service import RpcService
from shoal.shared.config import Settings
from shoal.shared.errors import Unavailable
from shoal.shared.metrics import new_registry
from shoal.shared.metrics_endpoint import MetricsEndpoint
from shoal.shared.schemas.common import Empty
from shoal.shared.schemas.registry import ModelCreate
from shoal.shared.schemas.scheduler import PlacementPlan, SchedulerStatus
from shoal.shared.version import VERSION


class SchedulerReplica:
    def __init__(self, settings: Settings) -> None:
        if not settings.database_url:
            raise Unavailable("the scheduler elects its leader in the registry's Postgres: set "
                              "SHOAL_DATABASE_URL or start the stack with `shoal up`")
        self.settings = settings
        self.identity = settings.scheduler_name or default_identity()
        self.election = PostgresElection(settings.database_url, self.identity,
                                         settings.scheduler_election_interval)
        self.service: SchedulerService | None = None

    async def serve(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        """Serve until `stop` is set; `ready` once registered and campaigning (leader or not)."""
        bus = await Bus.connect(self.settings, name="shoal-scheduler")
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(bus.close)
            metrics = new_registry()
            rpc = RpcService(bus, "shoal-scheduler", VERSION, bus.subjects.scheduler_group,
                             "Shoal scheduler: places instances; one replica leads", metrics)
            await rpc.start()
            stack.push_async_callback(rpc.stop)
            self.service = SchedulerService(RegistryClient(bus),
                                            SchedulerConfig.from_settings(self.settings))
            await rpc.endpoint("leader", "get", Empty, self.status)
            await rpc.endpoint("placement", "plan", ModelCreate, self.plan)
            await bus.nc.flush()  # the server knows the endpoints before `ready` (as the registry)
            metrics.register(SchedulerCollector(self.identity, self.election, self.service))
            endpoint = MetricsEndpoint(metrics, "scheduler", self.settings,
                                       labels={"replica": self.identity})
            await endpoint.start(bus)
            stack.push_async_callback(endpoint.stop)
            resign = asyncio.Event()
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self.election.run(resign), name="scheduler-election")
                tasks.create_task(self._serve(bus, stop, ready, resign), name="scheduler")

    async def _serve(self, bus: Bus, stop: asyncio.Event, ready: asyncio.Event | None,
                     resign: asyncio.Event) -> None:
        assert self.service is not None
        try:
            await self.service.run(bus, stop, ready, self.election)
        finally:
            resign.set()

    async def status(self, _req: Empty) -> SchedulerStatus:
        term = self.election.term
        return SchedulerStatus(replica=self.identity, is_leader=term is not None,
                               leader=self.election.leader,
                               leader_since=term.started_at if term else None)


    async def plan(self, model: ModelCreate) -> PlacementPlan:
        """The dry run; it shares the service's profile cache (a GGUF header is read once)."""
        assert self.service is not None
        return await plan_dry_run(self.service.registry, self.service.profiles, model)


async def run_scheduler(settings: Settings, stop: asyncio.Event,
                        ready: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set (the shape of run_registry / run_worker, for `shoal up`)."""
    await SchedulerReplica(settings).serve(stop, ready)
