"""Worker liveness: record heartbeats, and mark silent workers NOT_READY (instances UNREACHABLE).

Safe with several registries running: every state change is a versioned write, so two monitors
marking the same worker cannot both succeed, and a lost race is simply retried next tick.
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.msg import Msg

from shoal.services.registry.api import RegistryApi
from shoal.services.registry.outbox import transaction
from shoal.services.registry.repo.common import database_down
from shoal.shared.errors import Conflict
from shoal.shared.loops import run_every
from shoal.shared.schemas.events import EventKind
from shoal.shared.schemas.registry import WorkerHeartbeat

log = logging.getLogger(__name__)


class Liveness:
    def __init__(self, api: RegistryApi, timeout_s: float, check_interval_s: float) -> None:
        self.api = api
        self.timeout_s = timeout_s
        self.check_interval_s = check_interval_s

    async def on_heartbeat(self, hb: WorkerHeartbeat, _msg: Msg) -> None:
        try:
            async with transaction(self.api.sessions):
                changes = await self.api.workers.heartbeat(hb)
                if changes is not None:
                    await self._publish(changes)
        except Conflict:
            return  # another registry recorded the comeback first
        except Exception as exc:
            self._database_down("heartbeat", exc)
            return
        self.api.outage.recovered()
        if changes is None:
            log.info("heartbeat from unknown worker %s (it will register again)", hb.worker_id)
            return
        self.api.relay.kick()

    async def run(self, stop: asyncio.Event) -> None:
        await run_every(self.check_interval_s, stop, self.check, "liveness check", log, expected=())

    async def check(self) -> None:
        try:
            async with transaction(self.api.sessions):
                await self._publish(await self.api.workers.mark_silent(self.timeout_s))
        except Conflict:
            return  # another registry marked them first
        except Exception as exc:
            self._database_down("liveness check", exc)
            return
        self.api.outage.recovered()
        self.api.relay.kick()

    def _database_down(self, what: str, exc: Exception) -> None:
        """A lost database goes to the outage log (a line now and then); anything else is
        raised on, to be logged with its traceback."""
        cause = database_down(exc)
        if cause is None:
            raise exc
        self.api.outage.failed(what, cause)

    async def _publish(self, changes: tuple[list, list]) -> None:
        workers, instances = changes
        for worker in workers:
            log.warning("worker %s is %s", worker.name, worker.state.value)
            await self.api.worker_event(EventKind.UPDATED, worker)
        for instance in instances:
            await self.api.instance_event(EventKind.UPDATED, instance)
