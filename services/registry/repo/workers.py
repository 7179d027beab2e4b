"""Workers: register (idempotent by name), read, list, delete, leave, heartbeats and liveness.

Heartbeats refresh `last_heartbeat_at` and the device status with a plain UPDATE that does not
bump `version`: they are liveness data owned by the worker alone, and versioning them would make
every admin write race a heartbeat. State changes (READY <-> NOT_READY) are versioned writes.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from shoal.services.registry.repo.common import get_or_404, unit_of_work, workers_of
from shoal.services.registry.repo.convert import instance_public, worker_public
from shoal.shared.db.tables import InstanceRow, WorkerRow
from shoal.shared.schemas.common import Page, utcnow
from shoal.shared.schemas.registry import (
    ById, DeleteRequest, InstancePublic, ListRequest, WorkerHeartbeat, WorkerLeave, WorkerPublic,
    WorkerRegister,
)
from shoal.shared.states import InstanceState, WorkerState, can_transition

Changes = tuple[list[WorkerPublic], list[InstancePublic]]
LEFT = "the worker agent stopped"
"""The state message of a worker whose agent left (`leave`): only a registration brings it back,
not a heartbeat that was on its way when the agent left."""
KEPT = "engine(s) left running"
"""The end of a left worker's message while engines it left still serve (`leave`): the only
NOT_READY workers whose instances a heartbeat timeout still has to take out of service."""
_ENGINE_STATES = [InstanceState.DOWNLOADING.value, InstanceState.STARTING.value,
                  InstanceState.RUNNING.value]


class WorkerRepo:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.sessions = sessions

    async def register(self, req: WorkerRegister) -> tuple[WorkerPublic, bool,
                                                           list[InstancePublic]]:
        """Create the worker, or refresh the one with that name.

        Returns (worker, created, instances whose state changed). A worker that registers again
        has just (re)started: its UNREACHABLE instances go back to SCHEDULED, and those it was
        running (DOWNLOADING / STARTING / RUNNING) to STARTING, so nobody routes to an engine
        that is gone; but for the instances in `req.running`, whose engines outlived the agent
        and were adopted: those keep serving.
        """
        async with unit_of_work(self.sessions, f"worker {req.name!r}") as s:
            row = await s.scalar(select(WorkerRow).where(WorkerRow.name == req.name))
            created = row is None
            if row is None:
                row = WorkerRow(name=req.name)
                s.add(row)
            row.hostname, row.labels, row.simulated = req.hostname, req.labels, req.simulated
            row.status = req.status.model_dump(mode="json")
            row.state, row.state_message = WorkerState.READY.value, None
            row.last_heartbeat_at = utcnow()
            await s.flush()
            changed = [] if created else await self._restart_instances(s, row.id,
                                                                       set(req.running))
            return worker_public(row), created, changed

    async def get(self, req: ById) -> WorkerPublic:
        async with self.sessions() as s:
            return worker_public(await get_or_404(s, WorkerRow, req.id, "worker"))

    async def list(self, req: ListRequest) -> Page[WorkerPublic]:
        async with self.sessions() as s:
            query = select(WorkerRow).order_by(WorkerRow.name)
            rows = await s.scalars(query.limit(req.limit).offset(req.offset))
            total = await s.scalar(select(func.count()).select_from(WorkerRow)) or 0
            return Page[WorkerPublic](items=[worker_public(r) for r in rows], total=total)

    async def delete(self, req: DeleteRequest) -> WorkerPublic:
        async with unit_of_work(self.sessions, f"worker {req.id!r}") as s:
            row = await get_or_404(s, WorkerRow, req.id, "worker")
            public = worker_public(row)
            await s.delete(row)
            return public

    async def heartbeat(self, hb: WorkerHeartbeat) -> Changes | None:
        """Record a heartbeat. None when the worker is unknown (it must register again)."""
        async with unit_of_work(self.sessions, f"worker {hb.worker_id!r}") as s:
            result = await s.execute(
                update(WorkerRow).where(WorkerRow.id == hb.worker_id)
                .values(last_heartbeat_at=utcnow(), status=hb.status.model_dump(mode="json"))
                .returning(WorkerRow.state, WorkerRow.state_message)
            )
            row = result.one_or_none()
            if row is None:
                return None
            state, message = row
            if state != WorkerState.NOT_READY.value or (message or "").startswith(LEFT):
                return [], []  # a heartbeat its agent sent before leaving: it registers to return
            return await self._came_back(s, hb)

    async def _came_back(self, s: AsyncSession, hb: WorkerHeartbeat) -> Changes:
        """NOT_READY -> READY; its UNREACHABLE instances resume the state the worker reports."""
        row = await get_or_404(s, WorkerRow, hb.worker_id, "worker")
        row.state, row.state_message = WorkerState.READY.value, None
        changed = await self._resume_instances(s, row.id, hb.instances)
        await s.flush()
        return [worker_public(row)], changed

    async def _restart_instances(self, s: AsyncSession, worker_id: str,
                                 running: set[str]) -> list[InstancePublic]:
        """The instances of a restarted worker go back to STARTING, but for those whose engine
        outlived the agent (`running`): those keep their state and go on serving."""
        stale = [i for i in await s.scalars(select(InstanceRow).where(
            InstanceRow.worker_id == worker_id, InstanceRow.state.in_(_ENGINE_STATES)))
                 if i.id not in running]
        for inst in stale:
            inst.state, inst.state_changed_at = InstanceState.STARTING.value, utcnow()
            inst.state_message = "worker restarted: starting the engine again"
        await s.flush()
        return [instance_public(i) for i in stale] + await self._resume_instances(
            s, worker_id, {i: InstanceState.RUNNING for i in running})

    @staticmethod
    async def _resume_instances(s: AsyncSession, worker_id: str,
                                reported: dict[str, InstanceState]) -> list[InstancePublic]:
        """UNREACHABLE instances of a worker that is back take the state it reports, else
        SCHEDULED (the worker will start them)."""
        instances = list(await s.scalars(select(InstanceRow).where(
            InstanceRow.worker_id == worker_id,
            InstanceRow.state == InstanceState.UNREACHABLE.value)))
        for inst in instances:
            target = reported.get(inst.id, InstanceState.SCHEDULED)
            if not can_transition(InstanceState.UNREACHABLE, target):
                target = InstanceState.SCHEDULED
            inst.state, inst.state_message, inst.state_changed_at = target.value, None, utcnow()
        await s.flush()
        return [instance_public(i) for i in instances]

    async def leave(self, req: WorkerLeave) -> tuple[WorkerPublic, list[InstancePublic]]:
        """A worker whose agent stops cleanly: NOT_READY at once, and its instances UNREACHABLE as
        after a heartbeat timeout (the scheduler moves them after `reschedule_after`), but for
        those whose engines it left running (`req.running`): they go on serving until the next
        agent adopts them, or until the heartbeat timeout if none comes (`mark_silent`)."""
        async with unit_of_work(self.sessions, f"worker {req.id!r}") as s:
            row = await get_or_404(s, WorkerRow, req.id, "worker")
            row.state = WorkerState.NOT_READY.value
            row.state_message = LEFT + (f"; {len(req.running)} {KEPT}" if req.running else "")
            changed = await self._unreachable(s, {row.id: row}, "worker {} stopped", utcnow(),
                                              keep=frozenset(req.running))
            return worker_public(row), changed

    async def mark_silent(self, timeout_s: float, now: datetime | None = None) -> Changes:
        """Workers silent for `timeout_s` -> NOT_READY, their placed instances UNREACHABLE (also
        those a worker that left kept serving, once its agent has been away that long)."""
        now = now or utcnow()
        cutoff = now - timedelta(seconds=timeout_s)
        async with unit_of_work(self.sessions, "silent workers") as s:
            # Workers already NOT_READY were dealt with when they went (their instances are
            # UNREACHABLE), but for a left one whose kept engines still serve.
            rows = list(await s.scalars(select(WorkerRow).where(
                WorkerRow.last_heartbeat_at < cutoff,
                (WorkerRow.state != WorkerState.NOT_READY.value)
                | WorkerRow.state_message.endswith(KEPT))))
            if not rows:
                return [], []
            for row in rows:
                since = f"no heartbeat since {row.last_heartbeat_at:%Y-%m-%d %H:%M:%S}Z"
                left = row.state == WorkerState.NOT_READY.value
                row.state = WorkerState.NOT_READY.value
                row.state_message = f"{LEFT}; {since}" if left else since
            changed = await self._unreachable(s, {r.id: r for r in rows},
                                              "worker {} stopped heartbeating", now)
            return [worker_public(r) for r in rows], changed

    @staticmethod
    async def _unreachable(s: AsyncSession, gone: dict[str, WorkerRow], why: str,
                           now: datetime, keep: frozenset[str] = frozenset()
                           ) -> list[InstancePublic]:
        """The placed instances on the `gone` workers (their own or a pipeline stage's) ->
        UNREACHABLE, `why` naming the worker; but for `keep`."""
        placed = await s.scalars(select(InstanceRow).where(
            InstanceRow.state.notin_([InstanceState.PENDING.value,
                                      InstanceState.UNREACHABLE.value])))
        changed = []
        for inst in placed:
            on = workers_of(inst) & gone.keys()
            if not on or inst.id in keep:
                continue
            inst.state = InstanceState.UNREACHABLE.value
            inst.state_message = why.format(gone[sorted(on)[0]].name)
            inst.state_changed_at = now
            changed.append(inst)
        await s.flush()
        return [instance_public(i) for i in changed]
