"""Rank 0's side of an instance whose pipeline stages run on several workers.

The lead worker's engine process is rank 0: it opens the rendezvous (its TCPStore), answers
`ranks(instance_id)` with the RankPlan, and keeps one instance state for every rank: a
subordinate worker reports a rank of its own that ended on `rank_exits(instance_id)`, and a
subordinate worker that stops heartbeating counts as failed once `heartbeat_timeout` passes.
Either fails the engine, naming the rank and the worker (executor.py's failure names them too
when a collective breaks first). Nothing but this control plane crosses the bus.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from dataclasses import asdict

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shoal.services.engine.config import EngineConfig
from shoal.shared.bus.client import Bus
from shoal.shared.bus.codec import encode
from shoal.shared.config import Settings
from shoal.shared.embedded import free_port
from shoal.shared.loops import run_every
from shoal.shared.schemas.ranks import RankExit, RankPlan, RankPlanRequest, rank_layout
from shoal.shared.schemas.registry import InstancePublic, WorkerHeartbeat

log = logging.getLogger(__name__)
SILENCE_CHECK_S = 1.0


def rendezvous_host(settings: Settings) -> str:
    """The address the other workers reach this worker's store by: `distributed_host`, else
    this machine's name as it resolves here (127.0.0.1 when it does not)."""
    if settings.distributed_host:
        return settings.distributed_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class RankCoordinator:
    """Publishes the plan of a multi-worker instance and watches its subordinate workers."""

    def __init__(self, bus: Bus, settings: Settings, instance: InstancePublic,
                 config: EngineConfig) -> None:
        self.bus = bus
        self.instance = instance
        self.layout = rank_layout(instance)
        self.silence_after = settings.heartbeat_timeout
        host = rendezvous_host(settings)
        self.init_method = f"tcp://{host}:{free_port(None, host)}"
        self.config = EngineConfig(**{**asdict(config),
                                      "distributed_init_method": self.init_method})
        self.plan = RankPlan(instance_id=instance.id, generation=uuid.uuid4().hex,
                             init_method=self.init_method, world_size=instance.tp * instance.pp,
                             workers=self.layout, config=asdict(self.config))
        self._failures: dict[int, str] = {}
        self._last_seen = {w.worker_id: time.monotonic() for w in self.layout[1:]}
        self._subs: list[Subscription] = []
        self._watch: asyncio.Task[None] | None = None

    @property
    def local_ranks(self) -> list[int]:
        """The ranks > 0 the lead worker runs itself (children of this engine process)."""
        return [r for r in self.layout[0].ranks if r != 0]

    def failures(self) -> dict[int, str]:
        """rank -> what ended it (read from the engine's threads: a copy)."""
        return dict(self._failures)

    def failure_message(self) -> str | None:
        if not self._failures:
            return None
        return (f"parallel engine (TP={self.instance.tp} PP={self.instance.pp}): "
                + ", ".join(self._failures[r] for r in sorted(self._failures)))

    async def start(self) -> None:
        subjects = self.bus.subjects
        # silence counts from now: the model files were being prepared since construction,
        # and heartbeats are heard only from here on (a heartbeat timeout shorter than the
        # preparation failed every start at once)
        self._last_seen = {w.worker_id: time.monotonic() for w in self.layout[1:]}
        self._subs = [
            await self.bus.nc.subscribe(subjects.ranks(self.instance.id), cb=self._on_plan),
            await self.bus.subscribe(subjects.rank_exits(self.instance.id), RankExit,
                                     self._on_exit),
        ]
        for worker in self.layout[1:]:
            self._subs.append(await self.bus.subscribe(subjects.heartbeat(worker.worker_id),
                                                       WorkerHeartbeat, self._on_heartbeat))
        await self.bus.nc.flush()
        self._watch = asyncio.create_task(self._watch_silence(), name="rank-silence")
        log.info("rendezvous of %s at %s: %s", self.instance.name, self.init_method,
                 "; ".join(f"{w.worker_name} runs ranks {w.ranks}" for w in self.layout))

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - the connection may be closing
                pass

    async def _on_plan(self, msg: Msg) -> None:
        if msg.reply:
            await self.bus.nc.publish(msg.reply, encode(self.plan))
        try:
            asker = RankPlanRequest.model_validate_json(msg.data).worker_id
        except ValueError:
            asker = "?"
        log.debug("worker %s asked for the ranks of %s", asker, self.instance.name)

    async def _on_exit(self, event: RankExit, _msg: Msg) -> None:
        if event.generation != self.plan.generation:
            return  # a rank of an earlier start of this instance
        log.warning("%s%s", event.describe(), f": {event.log_tail}" if event.log_tail else "")
        self._failures.setdefault(event.rank, event.describe())

    async def _on_heartbeat(self, beat: WorkerHeartbeat, _msg: Msg) -> None:
        self._last_seen[beat.worker_id] = time.monotonic()

    async def _watch_silence(self) -> None:
        await run_every(SILENCE_CHECK_S, None, self._check_silence, "subordinate silence check",
                        log, first_wait=True)

    async def _check_silence(self) -> None:
        now = time.monotonic()
        for worker in self.layout[1:]:
            quiet = now - self._last_seen[worker.worker_id]
            if quiet > self.silence_after:
                for rank in worker.ranks:
                    self._failures.setdefault(
                        rank, f"rank {rank} on worker {worker.worker_name}: the worker went "
                              f"silent (no heartbeat for {quiet:.0f} s)")
