"""Stored Responses API answers: put (once per id), get and delete, each scoped to the key that
created the response (another key's, or a keyless request's, is not found: nothing leaks)."""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from shoal.services.registry.repo.common import unit_of_work
from shoal.shared.db.tables import ResponseRow
from shoal.shared.errors import NotFound
from shoal.shared.schemas.registry import Deleted, ResponseRef, StoredResponse


def _missing(ref: ResponseRef) -> NotFound:
    return NotFound(f"no response {ref.id!r} (a stored response is seen only with the key that "
                    "created it)", param="response_id")


class ResponseRepo:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.sessions = sessions

    async def put(self, req: StoredResponse) -> Deleted:
        async with unit_of_work(self.sessions, f"response {req.id!r}") as s:
            s.add(ResponseRow(**req.model_dump()))
        return Deleted(id=req.id)

    async def get(self, ref: ResponseRef) -> StoredResponse:
        async with self.sessions() as s:
            row = (await s.execute(select(ResponseRow).where(
                ResponseRow.id == ref.id, _owned(ref)))).scalar_one_or_none()
        if row is None:
            raise _missing(ref)
        return StoredResponse(id=row.id, key_id=row.key_id, model=row.model,
                              previous_response_id=row.previous_response_id,
                              conversation=row.conversation, response=row.response)

    async def delete(self, ref: ResponseRef) -> Deleted:
        async with unit_of_work(self.sessions, f"response {ref.id!r}") as s:
            gone = await s.execute(delete(ResponseRow).where(ResponseRow.id == ref.id,
                                                             _owned(ref)))
        if not gone.rowcount:  # type: ignore[attr-defined]
            raise _missing(ref)
        return Deleted(id=ref.id)


def _owned(ref: ResponseRef):  # type: ignore[no-untyped-def]
    return (ResponseRow.key_id.is_(None) if ref.key_id is None
            else ResponseRow.key_id == ref.key_id)
