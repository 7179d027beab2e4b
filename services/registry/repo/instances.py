"""Instances: create for a model, read, list, state transitions (the state machine), delete.

A transition names the version it read; an illegal move or a stale version is refused before
anything is written. SCHEDULED takes a placement; back to PENDING clears it. A transition to the
same state only updates the message (the scheduler's "why not placed" on PENDING instances).
The scheduler's writes carry a leader fence, checked in the same transaction (fencing.py); a
worker's and an engine's name the placement they serve (shared/placement_fence.py).
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from shoal.services.registry.repo.common import (
    check_version, get_or_404, unit_of_work, workers_of
)
from shoal.services.registry.repo.convert import instance_public
from shoal.services.registry.repo.fencing import check_fence
from shoal.shared.placement_fence import check_placement
from shoal.shared.db.base import new_id
from shoal.shared.db.tables import InstanceRow, ModelRow, WorkerRow
from shoal.shared.errors import InvalidRequest, NotFound
from shoal.shared.schemas.common import Page, utcnow
from shoal.shared.schemas.registry import (
    ById, InstanceCreate, InstanceDelete, InstanceFilter, InstancePublic, InstanceTransition
)
from shoal.shared.states import InstanceState, check_transition


class InstanceRepo:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.sessions = sessions

    async def create(self, req: InstanceCreate) -> InstancePublic:
        async with unit_of_work(self.sessions, "instance") as s:
            await check_fence(s, req.fence)
            model = await get_or_404(s, ModelRow, req.model_id, "model")
            row = InstanceRow(
                id=new_id(), model_id=model.id, model_name=model.name,
                state=InstanceState.PENDING.value,
                state_changed_at=utcnow(), restart_count=0,
                run_revision=model.run_revision or 0,
            )
            row.name = f"{model.name}-{row.id[:8]}"
            s.add(row)
            await s.flush()
            return instance_public(row)

    async def get(self, req: ById) -> InstancePublic:
        async with self.sessions() as s:
            return instance_public(await get_or_404(s, InstanceRow, req.id, "instance"))

    async def list(self, req: InstanceFilter) -> Page[InstancePublic]:
        query = select(InstanceRow)
        if req.model_id:
            query = query.where(InstanceRow.model_id == req.model_id)
        if req.worker_id and not req.include_subordinate:
            query = query.where(InstanceRow.worker_id == req.worker_id)
        if req.state:
            query = query.where(InstanceRow.state == req.state.value)
        async with self.sessions() as s:
            rows = list(await s.scalars(query.order_by(InstanceRow.created_at, InstanceRow.id)))
            if req.worker_id and req.include_subordinate:  # placement is JSON: filtered here
                rows = [r for r in rows if req.worker_id in workers_of(r)]
            return Page[InstancePublic](items=[instance_public(r) for r in rows], total=len(rows))

    async def transition(self, req: InstanceTransition) -> InstancePublic:
        """One versioned write: every read happens before the row is touched (an autoflush in
        between would bump the version twice)."""
        async with unit_of_work(self.sessions, f"instance {req.id!r}") as s:
            await check_fence(s, req.fence)
            row = await get_or_404(s, InstanceRow, req.id, "instance")
            check_version(row.version, req.version, f"instance {row.name!r}")
            check_placement(f"instance {row.name!r}", _generation(row), req.placement_generation)
            current = InstanceState(row.state)
            if req.state is not current:
                check_transition(current, req.state)
            worker = await self._placement_worker(s, row, req)
            if req.state is not current:
                row.state = req.state.value
                row.state_changed_at = utcnow()
            if worker is not None and req.placement is not None:
                row.worker_id, row.worker_name = worker.id, worker.name
                # the version it was read at: unique to this placement (versions only grow)
                row.placement = req.placement.model_copy(
                    update={"generation": row.version}).model_dump(mode="json")
            elif req.state is InstanceState.PENDING:
                row.worker_id = row.worker_name = row.placement = None
            row.state_message = req.state_message
            if req.restart_count is not None:
                row.restart_count = req.restart_count
            await s.flush()
            return instance_public(row)

    async def delete(self, req: InstanceDelete) -> InstancePublic:
        async with unit_of_work(self.sessions, f"instance {req.id!r}") as s:
            await check_fence(s, req.fence)
            row = await get_or_404(s, InstanceRow, req.id, "instance")
            check_version(row.version, req.version, f"instance {row.name!r}")
            public = instance_public(row)
            await s.delete(row)
            return public

    @staticmethod
    async def _placement_worker(s: AsyncSession, row: InstanceRow,
                                req: InstanceTransition) -> WorkerRow | None:
        """Validate the placement rules and return the worker a new placement names."""
        if req.placement is not None and req.state is not InstanceState.SCHEDULED:
            raise InvalidRequest("a placement can only be given when moving to SCHEDULED",
                                 param="placement")
        if req.placement is None:
            if req.state is InstanceState.SCHEDULED and row.worker_id is None:
                raise InvalidRequest("moving to SCHEDULED needs a placement", param="placement")
            return None
        if row.state == InstanceState.SCHEDULED.value:
            raise InvalidRequest("the instance is already placed; move it to PENDING first",
                                 param="placement")
        worker = await s.get(WorkerRow, req.placement.worker_id)
        if worker is None:
            raise NotFound(f"worker {req.placement.worker_id!r} not found")
        return worker


def _generation(row: InstanceRow) -> int | None:
    """The generation of the row's placement; None when it is not placed."""
    if row.placement is None:
        return None
    return int(row.placement.get("generation", 0))
