"""Models: create, read, list, update (any field a create sets but the name), delete with
instances."""

from __future__ import annotations

from pydantic import ValidationError
from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from shoal.services.registry.repo.common import check_version, get_or_404, unit_of_work
from shoal.services.registry.repo.convert import instance_public, model_public
from shoal.shared.bus.codec import refusal
from shoal.shared.db.tables import InstanceRow, ModelRow
from shoal.shared.errors import Conflict, InvalidRequest, NotFound
from shoal.shared.schemas.common import Page
from shoal.shared.schemas.registry import (
    MAX_SCALE_EVENTS, RUN_FIELDS, ByIdOrName, DeleteRequest, InstancePublic, ListRequest,
    ModelCreate, ModelPublic, ModelSpec, ModelUpdate
)


class ModelRepo:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.sessions = sessions

    async def create(self, req: ModelCreate) -> ModelPublic:
        spec = ModelSpec.model_validate(req.model_dump(exclude={"name"}))
        async with unit_of_work(self.sessions, f"model {req.name!r}") as s:
            await _lock_names(s)
            if await s.scalar(select(ModelRow.id).where(ModelRow.name == req.name)):
                raise Conflict(f"a model named {req.name!r} already exists", code="model_exists")
            await _check_names_free(s, None, [req.name, *spec.aliases])
            row = ModelRow(name=req.name, spec=spec.model_dump(mode="json"))
            s.add(row)
            await s.flush()
            return model_public(row)

    async def get(self, req: ByIdOrName) -> ModelPublic:
        async with self.sessions() as s:
            return model_public(await self._find(s, req))

    async def list(self, req: ListRequest) -> Page[ModelPublic]:
        async with self.sessions() as s:
            query = select(ModelRow).order_by(ModelRow.name)
            rows = await s.scalars(query.limit(req.limit).offset(req.offset))
            total = await s.scalar(select(func.count()).select_from(ModelRow)) or 0
            return Page[ModelPublic](items=[model_public(r) for r in rows], total=total)

    async def update(self, req: ModelUpdate) -> ModelPublic:
        async with unit_of_work(self.sessions, f"model {req.id!r}") as s:
            row = await get_or_404(s, ModelRow, req.id, "model")
            check_version(row.version, req.version, f"model {row.name!r}")
            changes = req.model_dump(exclude={"id", "version"}, exclude_unset=True, mode="json")
            event = changes.pop("scale_event", None)
            try:  # each field was checked alone; the result must fit as a create's would
                spec = ModelSpec.model_validate({**row.spec, **changes})
            except ValidationError as exc:
                raise refusal(exc, whole="the updated model") from None
            if "aliases" in changes:
                if row.name in spec.aliases:
                    raise InvalidRequest(f"aliases: {row.name!r} is the model's name already",
                                         param="aliases")
                await _lock_names(s)
                await _check_names_free(s, row.id, spec.aliases)
            before = ModelSpec.model_validate(row.spec).model_dump(mode="json",
                                                                   include=set(RUN_FIELDS))
            row.spec = spec.model_dump(mode="json")
            if before != spec.model_dump(mode="json", include=set(RUN_FIELDS)):
                row.run_revision = (row.run_revision or 0) + 1  # the scheduler rolls them
            if event is not None:  # the autoscaler's reason, kept with the model
                row.scale_events = [*(row.scale_events or []), event][-MAX_SCALE_EVENTS:]
            await s.flush()
            return model_public(row)

    async def delete(self, req: DeleteRequest) -> tuple[ModelPublic, list[InstancePublic]]:
        """Delete a model and its instances (workers stop them on the instance events)."""
        async with unit_of_work(self.sessions, f"model {req.id!r}") as s:
            row = await get_or_404(s, ModelRow, req.id, "model")
            check_version(row.version, req.version, f"model {row.name!r}")
            query = select(InstanceRow).where(InstanceRow.model_id == row.id)
            instances = list(await s.scalars(query))
            gone = [instance_public(i) for i in instances]
            for instance in instances:
                await s.delete(instance)
            public = model_public(row)
            await s.delete(row)
            return public, gone

    @staticmethod
    async def _find(s: AsyncSession, req: ByIdOrName) -> ModelRow:
        if req.id:
            return await get_or_404(s, ModelRow, req.id, "model")
        if not req.name:
            raise InvalidRequest("give a model id or name", param="id")
        row = await s.scalar(select(ModelRow).where(ModelRow.name == req.name))
        if row is None:
            raise NotFound(f"model {req.name!r} not found", code="model_not_found")
        return row


_NAMES_LOCK = 0x5340A3
"""A transaction advisory lock around the writes that claim model names and aliases: two
creates giving one alias cannot both pass the check (names alone have a unique index)."""


async def _lock_names(s: AsyncSession) -> None:
    await s.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _NAMES_LOCK})


async def _check_names_free(s: AsyncSession, model_id: str | None, names: list[str]) -> None:
    """Conflict (409) when one of `names` is another model's name or alias: a request for a
    name must reach one model. Models are few: their specs are read whole. On create
    (model_id None) names[0] is the new model's name."""
    wanted = set(names)
    for row in await s.scalars(select(ModelRow)):
        if row.id == model_id:
            continue
        taken = wanted & {row.name, *(row.spec or {}).get("aliases", [])}
        if taken:
            param = "name" if model_id is None and names[0] in taken else "aliases"
            raise Conflict(f"{', '.join(sorted(taken))}: already a name or alias of model "
                           f"{row.name!r}", param=param, code="model_exists")
