"""The scheduler service: registry events (JetStream durable consumer) + a periodic reconcile.

With an election (run_scheduler always has one) it acts only while its replica leads, and every
write carries the term's fence, so the registry refuses the writes of a leader that lost the lock.
Every write also names the version it read, so two writers cannot both place one instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from nats.aio.msg import Msg

from shoal.services.scheduler.claim import ModelProfile
from shoal.services.scheduler.election import Leadership, Term
from shoal.services.scheduler.planner import Planner, ProfileCache, build_request
from shoal.services.scheduler.policies.base import PlacementRequest
from shoal.services.scheduler.autoscale_loop import AutoscaleLoop
from shoal.services.scheduler.reconcile import PassPlan, SchedulerConfig, plan_pass
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.db.leader_lock import NOT_LEADER
from shoal.shared.errors import Conflict, NotFound, ShoalError
from shoal.shared.loops import first_of, run_every
from shoal.shared.schemas.common import utcnow
from shoal.shared.schemas.registry import (
    InstanceCreate, InstanceDelete, InstancePublic, InstanceTransition, LeaderFence, ListRequest,
    ModelPublic, WorkerPublic,
)
from shoal.shared.states import InstanceState

log = logging.getLogger(__name__)
T = TypeVar("T")
PAGE_SIZE = 1000


@dataclass(slots=True)
class PassStats:
    created: int = 0
    deleted: int = 0
    unscheduled: int = 0
    scheduled: int = 0
    pending: int = 0
    conflicts: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)


class SchedulerService:
    def __init__(self, registry: RegistryClient, config: SchedulerConfig,
                 profiles: ProfileCache | None = None) -> None:
        self.registry = registry
        self.config = config
        self.profiles = profiles or ProfileCache()
        self.kick = asyncio.Event()
        self.lock = asyncio.Lock()
        self.passes = 0
        self.jitter = random.Random()
        """Spreads the periodic passes of unelected writers apart (each waits interval +-10%)."""
        self.fence: LeaderFence | None = None
        """The current term's fence, sent with every write (None without an election)."""
        self.snapshot: tuple[list[WorkerPublic], list[InstancePublic]] | None = None
        """The fleet as the last pass read it (PENDING instances carry why in their message)."""
        self.failures: dict[str, str] = {}
        """The last unexpected error of each model (by id), so its traceback is logged once."""

    # ------------------------------------------------------------ loop
    async def run(self, bus: Bus, stop: asyncio.Event, ready: asyncio.Event | None = None,
                  leadership: Leadership | None = None) -> None:
        """Reconcile until `stop`: all along without `leadership` (a lone scheduler, tests),
        else only during this replica's terms as leader."""
        if ready is not None:
            ready.set()
        if leadership is None:
            await self._lead(bus, stop)
            return
        while (term := await leadership.next_term(stop)) is not None:
            await self._serve_term(bus, term, stop)

    async def _serve_term(self, bus: Bus, term: Term, stop: asyncio.Event) -> None:
        """Lead until the term ends or `stop`, then cancel the pass in flight: after a lost lock
        its writes would be refused anyway; on a clean stop the lock is released only after."""
        halt = asyncio.Event()
        self.fence = term.fence
        lead = asyncio.create_task(self._lead(bus, halt), name="scheduler-term")
        try:
            await first_of(term.ended.wait(), stop.wait(), lead)
        finally:
            halt.set()
            lead.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await lead
            self.fence = None

    async def _lead(self, bus: Bus, halt: asyncio.Event) -> None:
        """The event consumer plus a reconcile loop, until `halt` is set (or this is cancelled)."""
        consumer = asyncio.create_task(self._consume(bus, halt), name="scheduler-events")
        autoscaler = AutoscaleLoop(self.registry, self.config.autoscale_interval, self.kick.set)
        scaling = asyncio.create_task(autoscaler.run(bus, halt), name="scheduler-autoscale")
        try:  # a failed pass is logged; the next one comes (at once after an event)
            await run_every(self.config.interval, halt, self.reconcile, "reconcile", log,
                            wake=self.kick, jitter=lambda: self.jitter.uniform(0.9, 1.1),
                            debounce=self.config.debounce)
        finally:
            halt.set()
            consumer.cancel()
            scaling.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await consumer
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await scaling

    async def _consume(self, bus: Bus, stop: asyncio.Event) -> None:
        """The durable consumer; restarted after a failure (the periodic reconcile goes on)."""
        await run_every(1.0, stop, lambda: bus.consume(self.config.durable, bus.subjects.events_all,
                                                       self.on_event, stop),
                        "event consumer (retrying)", log, expected=(Exception,))

    async def on_event(self, _msg: Msg) -> None:
        self.kick.set()

    # ------------------------------------------------------------ one pass
    async def reconcile(self) -> PassStats:
        async with self.lock:
            self.passes += 1
            models = await self._every(self.registry.list_models)
            workers = await self._every(self.registry.list_workers)
            instances = await self.registry.list_instances()
            self.snapshot = (workers, instances)  # for the leader's cluster metrics
            plan = plan_pass(models, workers, instances, utcnow(), self.config)
            stats = PassStats()
            current = {i.id: i for i in instances}
            await self._execute(plan, current, stats)
            models_by_id = {m.id: m for m in models}
            self.failures = {k: v for k, v in self.failures.items() if k in models_by_id}
            planner = Planner(workers, current.values(), self.profiles)
            requests: dict[str, PlacementRequest | str] = {}
            pending = sorted((i for i in current.values() if i.state is InstanceState.PENDING),
                             key=lambda i: (i.created_at, i.id))
            for inst in pending:
                model = models_by_id.get(inst.model_id)
                if model is None:
                    continue
                if model.id not in requests:
                    requests[model.id] = await self._request(model)
                outcome = await self.place(inst, model, requests[model.id], planner)
                stats.outcomes[outcome] += 1
            stats.scheduled = stats.outcomes["scheduled"]
            stats.pending = stats.outcomes["pending"] + stats.outcomes["unchanged"]
            stats.conflicts += stats.outcomes["conflict"]
            if stats.created or stats.deleted or stats.unscheduled or stats.scheduled:
                log.info("reconcile: %d created, %d deleted, %d rescheduled, %d scheduled, "
                         "%d pending, %d conflicts", stats.created, stats.deleted,
                         stats.unscheduled, stats.scheduled, stats.pending, stats.conflicts)
            return stats

    @staticmethod
    async def _every(list_page: Callable[[ListRequest], Awaitable[list[T]]]) -> list[T]:
        """Every row of a paged registry list (pages of PAGE_SIZE)."""
        rows: list[T] = []
        while True:
            page = await list_page(ListRequest(limit=PAGE_SIZE, offset=len(rows)))
            rows += page
            if len(page) < PAGE_SIZE:
                return rows

    async def _execute(self, plan: PassPlan, current: dict[str, InstancePublic],
                       stats: PassStats) -> None:
        for inst in plan.delete:
            if await self._write(self.registry.delete_instance(InstanceDelete(
                    id=inst.id, version=inst.version, fence=self.fence)), stats) is not None:
                current.pop(inst.id, None)
                stats.deleted += 1
        for model in plan.create:
            created = await self._write(self.registry.create_instance(
                InstanceCreate(model_id=model.id, fence=self.fence)), stats)
            if created is not None:
                current[created.id] = created
                stats.created += 1
        for u in plan.unschedule:
            moved = await self._write(self.registry.transition_instance(InstanceTransition(
                id=u.instance.id, version=u.instance.version, state=InstanceState.PENDING,
                state_message=u.message, restart_count=u.restart_count, fence=self.fence)), stats)
            if moved is not None:
                log.info("instance %s back to PENDING: %s", moved.name, u.message)
                current[moved.id] = moved
                stats.unscheduled += 1

    async def _write(self, call: Awaitable[T], stats: PassStats) -> T | None:
        """Run one registry write; a stale version or a vanished row means someone else acted.
        A refused fence (this replica no longer leads) ends the pass."""
        try:
            return await call
        except (Conflict, NotFound) as exc:
            _raise_if_not_leader(exc)
            stats.conflicts += 1
            log.info("registry refused a write (%s); the next pass re-reads", exc.message)
            return None

    async def _request(self, model: ModelPublic) -> PlacementRequest | str:
        """The model's placement request, or why it cannot be sized or run (kept as its
        instances' message). Never raises: one bad model must not stop the pass."""
        try:
            profile: ModelProfile = await asyncio.to_thread(self.profiles.get, model.source)
        except ShoalError as exc:
            return f"Cannot size the model from {model.source}: {exc.message}"
        except Exception as exc:  # noqa: BLE001 - a bug for one model: that model fails alone
            return self._unexpected(model, "sizing", exc)
        try:
            return build_request(model, profile)
        except ShoalError as exc:
            return f"The model cannot run as deployed: {exc.message}"
        except Exception as exc:  # noqa: BLE001
            return self._unexpected(model, "sizing", exc)

    def _unexpected(self, model: ModelPublic, doing: str, exc: Exception) -> str:
        """An error no rule expected, for one model: logged with its traceback once (not every
        pass), and the reason its instances wait with."""
        reason = (f"The scheduler failed {doing} the model ({type(exc).__name__}: {exc}); its "
                  "log has the traceback")
        if self.failures.get(model.id) != reason:
            self.failures[model.id] = reason
            log.error("%s failed for model %s", doing, model.name, exc_info=exc)
        return reason

    async def place(self, inst: InstancePublic, model: ModelPublic,
                    request: PlacementRequest | str, planner: Planner) -> str:
        """Place one PENDING instance: 'scheduled', 'pending', 'unchanged' or 'conflict'."""
        if isinstance(request, str):
            return await self._keep_pending(inst, request)
        try:
            result = planner.place_request(request)
        except Exception as exc:  # noqa: BLE001 - the policy is pure: a bug, for this model only
            return await self._keep_pending(inst, self._unexpected(model, "placing", exc))
        if result.placement is None:
            return await self._keep_pending(inst, result.reason)
        try:
            placed = await self.registry.transition_instance(InstanceTransition(
                id=inst.id, version=inst.version, state=InstanceState.SCHEDULED,
                placement=result.placement, state_message=" ".join(result.placement.warnings)
                or None, fence=self.fence))
        except (Conflict, NotFound) as exc:
            _raise_if_not_leader(exc)
            log.info("instance %s was changed by someone else (%s): not placed", inst.name,
                     exc.message)
            return "conflict"
        planner.commit(result)
        log.info("scheduled %s: %s", placed.name, result.candidate.to_log_string()
                 if result.candidate else result.placement)
        return "scheduled"

    async def _keep_pending(self, inst: InstancePublic, reason: str) -> str:
        if inst.state_message == reason:
            return "unchanged"
        try:
            await self.registry.transition_instance(InstanceTransition(
                id=inst.id, version=inst.version, state=InstanceState.PENDING,
                state_message=reason, fence=self.fence))
        except (Conflict, NotFound) as exc:
            _raise_if_not_leader(exc)
            return "conflict"
        log.info("instance %s stays PENDING: %s", inst.name, reason)
        return "pending"


def _raise_if_not_leader(exc: ShoalError) -> None:
    if exc.code == NOT_LEADER:
        raise exc
