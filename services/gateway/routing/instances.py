"""The live instance table: RUNNING instances from the registry (a periodic list plus instance
events) joined with the engines' load messages. A request for a model with no instance here asks
the registry first (`catch_up`): the RUNNING event reaches this table a moment after the commit
that a client may already have seen, so "RUNNING" means "send now", never a 503 in between.

An instance that sends nothing (no load, no stream reply) for `gateway_engine_dead_after` seconds
is dead to the router: new requests go elsewhere until it publishes again. Its in-flight streams
are failed (`EngineGone`) only after `gateway_engine_stall_timeout`: an engine starved of CPU for
a few seconds (seen in the soak on an oversubscribed machine) still finishes them. Leaving
RUNNING in the registry (crash, restart, delete) fails its streams at once, and so does a lost
NATS connection: an engine's replies published meanwhile may never arrive, and a stream waiting
for them would hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from shoal.services.gateway.routing.router import Candidate, Router
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.errors import ShoalError
from shoal.shared.loops import run_every
from shoal.shared.schemas.events import EventKind, InstanceEvent
from shoal.shared.schemas.infer import EngineLoad
from shoal.shared.schemas.registry import InstanceFilter, InstancePublic
from shoal.shared.states import InstanceState

log = logging.getLogger(__name__)
MAX_LEFT = 4096
"""How many instances that left RUNNING are remembered (with the version they left at), so that
a registry answer older than their event does not bring them back."""


@dataclass(frozen=True, slots=True)
class EngineGone:
    """Put on a stream's queue when its engine is dead or left RUNNING."""

    reason: str


@dataclass(slots=True)
class LiveInstance:
    id: str
    model_name: str
    version: int
    last_seen: float
    """Monotonic time of the last load or stream reply (or of joining the table, as a grace
    period)."""
    joined_at: float = field(default_factory=time.monotonic)
    load: EngineLoad | None = None
    num_outstanding: int = 0
    is_dead: bool = False
    streams_failed: bool = False
    """Its streams were failed for silence; reset when it is heard again."""
    streams: set[asyncio.Queue[object]] = field(default_factory=set)


class InstanceTable:
    def __init__(self, bus: Bus, registry: RegistryClient, settings: Settings,
                 router: Router) -> None:
        self.bus = bus
        self.registry = registry
        self.settings = settings
        self.router = router
        self.instances: dict[str, LiveInstance] = {}
        self._left: OrderedDict[str, int] = OrderedDict()
        self._catching_up: dict[str, asyncio.Future[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._subs: list[object] = []

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self.bus.on_disconnect.append(self.bus_lost)
        names = self.bus.subjects
        self._subs.append(await self.bus.subscribe(names.load_all, EngineLoad, self._on_load))
        self._subs.append(await self.bus.subscribe(names.events_of("instances"), InstanceEvent,
                                                   self._on_event))
        with contextlib.suppress(ShoalError):
            await self.refresh()
        self._tasks = [asyncio.create_task(self._refresh_loop(), name="gateway-refresh"),
                       asyncio.create_task(self._watchdog(), name="gateway-watchdog")]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()  # type: ignore[attr-defined]
        for inst in self.instances.values():
            self._fail(inst, "the gateway is shutting down")

    async def refresh(self) -> None:
        started = time.monotonic()
        running = await self.registry.list_instances(InstanceFilter(state=InstanceState.RUNNING))
        seen = set()
        for inst in running:
            seen.add(inst.id)
            self._upsert(inst)
        for inst in list(self.instances.values()):
            if inst.id not in seen and inst.joined_at < started:
                self._remove(inst.id, "no longer RUNNING in the registry")

    async def catch_up(self, model_id: str) -> None:
        """Add the model's instances that the registry has RUNNING and no event has brought
        yet. Concurrent calls for one model share one registry call."""
        pending = self._catching_up.get(model_id)
        if pending is None:
            pending = asyncio.ensure_future(self._catch_up(model_id))
            self._catching_up[model_id] = pending
            pending.add_done_callback(lambda _f: self._catching_up.pop(model_id, None))
        await asyncio.shield(pending)

    async def _catch_up(self, model_id: str) -> None:
        for inst in await self.registry.list_instances(
                InstanceFilter(model_id=model_id, state=InstanceState.RUNNING)):
            self._upsert(inst)

    async def _refresh_loop(self) -> None:
        """A full list every gateway_instance_refresh (start() did the first), until cancelled."""
        await run_every(self.settings.gateway_instance_refresh, None, self.refresh,
                        "refreshing instances from the registry", log, first_wait=True)

    async def _watchdog(self) -> None:
        async def check() -> None:
            self.check_silence(time.monotonic())

        await run_every(max(0.05, self.settings.gateway_engine_dead_after / 4), None, check,
                        "engine silence check", log, first_wait=True)

    def check_silence(self, now: float) -> None:
        """Route around engines silent for `gateway_engine_dead_after`; fail the streams of those
        silent for `gateway_engine_stall_timeout`."""
        dead_after = self.settings.gateway_engine_dead_after
        stall = max(dead_after, self.settings.gateway_engine_stall_timeout)
        for inst in self.instances.values():
            silent = now - inst.last_seen
            if not inst.is_dead and silent > dead_after:
                inst.is_dead = True
                log.warning("instance %s sent nothing for %.1fs: routing around it", inst.id,
                            silent)
                self.router.affinity.forget(inst.id)
            if not inst.streams_failed and silent > stall:
                inst.streams_failed = True
                self._fail(inst, f"the engine of instance {inst.id} stopped responding "
                                 f"(nothing for {silent:.0f}s)")

    # ---------------------------------------------------------------- inputs
    async def _on_load(self, load: EngineLoad, msg: Msg) -> None:
        inst = self.instances.get(load.instance_id)
        if inst is None:
            return
        inst.load = load
        self.heard(inst)

    def heard(self, inst: LiveInstance) -> None:
        """A sign of life: a load message, or a reply on one of its streams."""
        inst.last_seen = time.monotonic()
        inst.streams_failed = False
        if inst.is_dead:
            log.info("instance %s is heard again", inst.id)
            inst.is_dead = False

    async def _on_event(self, event: InstanceEvent, msg: Msg) -> None:
        known = self.instances.get(event.id)
        if known is not None and event.version < known.version:
            return
        if event.kind is not EventKind.DELETED and event.data.state is InstanceState.RUNNING:
            self._upsert(event.data)
        else:
            self._remove(event.id, f"instance {event.id} left RUNNING ({event.data.state.value})",
                         event.version)

    def _upsert(self, data: InstancePublic) -> None:
        known = self.instances.get(data.id)
        if known is None:
            if data.version <= self._left.get(data.id, -1):
                return  # an answer older than the event that took it away
            self.instances[data.id] = LiveInstance(data.id, data.model_name, data.version,
                                                   time.monotonic())
        elif data.version > known.version:  # RUNNING again (its events in between missed):
            known.version = data.version    # a new engine, given the grace period of a new one
            known.joined_at = known.last_seen = time.monotonic()
            known.is_dead = known.streams_failed = False

    def _remove(self, instance_id: str, reason: str, version: int | None = None) -> None:
        if version is not None:
            self._left[instance_id] = max(version, self._left.get(instance_id, -1))
            self._left.move_to_end(instance_id)
            while len(self._left) > MAX_LEFT:
                self._left.popitem(last=False)
        inst = self.instances.pop(instance_id, None)
        if inst is not None:
            self.router.affinity.forget(instance_id)
            self._fail(inst, reason)

    def bus_lost(self) -> None:
        """NATS is gone: every stream in flight ends with an error now (its remaining replies
        may be lost across the reconnect) instead of waiting for them forever."""
        for inst in self.instances.values():
            self._fail(inst, "the gateway lost its connection to the message bus (NATS); "
                             "retry the request")

    def _fail(self, inst: LiveInstance, reason: str) -> None:
        for queue in list(inst.streams):
            queue.put_nowait(EngineGone(reason))

    # ---------------------------------------------------------------- queries
    def live(self, model_name: str) -> list[LiveInstance]:
        return [i for i in self.instances.values()
                if i.model_name == model_name and not i.is_dead
                and not (i.load and i.load.draining)]

    def candidates(self, model_name: str) -> list[Candidate]:
        return [Candidate(i.id, i.num_outstanding,
                          (i.load.num_running + i.load.num_waiting) if i.load else 0,
                          i.load.kv_cache_usage if i.load else 0.0) for i in self.live(model_name)]

    def model_names(self) -> list[str]:
        return sorted({i.model_name for i in self.instances.values() if not i.is_dead})

    def max_model_len(self, model_name: str) -> int | None:
        """The context its running engines serve (the smallest, if they differ); None when no
        engine of the model has reported yet."""
        lens = [i.load.max_model_len for i in self.instances.values()
                if i.model_name == model_name and i.load is not None and not i.is_dead]
        return min(lens) if lens else None

    def chat_template_tokens(self, model_name: str) -> int:
        """What the model's chat template adds to a chat (the most its engines report)."""
        return max((i.load.chat_template_tokens for i in self.instances.values()
                    if i.model_name == model_name and i.load is not None), default=0)

    def live_loads(self) -> list[EngineLoad]:
        return [i.load for i in self.instances.values() if i.load is not None and not i.is_dead]

    def watch(self, instance_id: str, queue: asyncio.Queue[object]) -> LiveInstance | None:
        inst = self.instances.get(instance_id)
        if inst is not None:
            inst.streams.add(queue)
            inst.num_outstanding += 1
        return inst

    def unwatch(self, inst: LiveInstance, queue: asyncio.Queue[object]) -> None:
        if queue in inst.streams:
            inst.streams.discard(queue)
            inst.num_outstanding -= 1
