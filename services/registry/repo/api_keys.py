"""API keys: the secret is shown once at creation; only its SHA-256 is stored.

Secrets carry 256 random bits, so a plain SHA-256 is enough (as for GitHub tokens): there is
nothing to brute-force, and verification stays one indexed lookup.

A name means one key not revoked (a unique partial index; a second is a 409 naming `name`), so
every call that takes an id takes a name too (`resolve`): the key not revoked with that name,
else the one revoked key with it; several revoked keys with one name are ambiguous (409 listing
their ids) rather than the first match.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from sqlalchemy import func, or_, select, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from shoal.services.registry.repo.common import check_version, unit_of_work
from shoal.services.registry.repo.convert import api_key_public
from shoal.shared.db.tables import ApiKeyRow
from shoal.shared.errors import Conflict, NotFound
from shoal.shared.schemas.common import Page, utcnow
from shoal.shared.schemas.registry import (
    ApiKeyCreate, ApiKeyCreated, ApiKeyPublic, ApiKeyScope, ApiKeyUpdate, ApiKeyVerified,
    ApiKeyVerify, ById, ListRequest, SECRET_PREFIX
)

def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class ApiKeyRepo:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.sessions = sessions

    async def create(self, req: ApiKeyCreate) -> ApiKeyCreated:
        secret = new_secret()
        async with unit_of_work(self.sessions, f"api key {req.name!r}") as s:
            await self._refuse_taken(s, req.name)
            scope = req.scope
            if scope is None:  # the bootstrap rule: the first usable key can manage the cluster
                # one creation at a time decides it (a transaction-scoped advisory lock)
                await s.execute(text("SELECT pg_advisory_xact_lock(hashtext('shoal_admin_key'))"))
                scope = ApiKeyScope.ADMIN if not await self._has_admin(s) else ApiKeyScope.INFERENCE
            row = ApiKeyRow(name=req.name, prefix=secret[: len(SECRET_PREFIX) + 4],
                            secret_hash=hash_secret(secret), expires_at=req.expires_at,
                            scope=scope.value,
                            limits=[limit.model_dump(mode="json") for limit in req.limits])
            s.add(row)
            await s.flush()
            return ApiKeyCreated(**api_key_public(row).model_dump(), secret=secret)

    async def list(self, req: ListRequest) -> Page[ApiKeyPublic]:
        async with self.sessions() as s:
            query = select(ApiKeyRow).order_by(ApiKeyRow.created_at)
            rows = await s.scalars(query.limit(req.limit).offset(req.offset))
            total = await s.scalar(select(func.count()).select_from(ApiKeyRow)) or 0
            return Page[ApiKeyPublic](items=[api_key_public(r) for r in rows], total=total)

    async def get(self, req: ById) -> ApiKeyPublic:
        async with self.sessions() as s:
            return api_key_public(await self.resolve(s, req.id))

    @staticmethod
    async def resolve(s: AsyncSession, target: str) -> ApiKeyRow:
        """The key whose id is `target`, else the one named `target` (module docstring)."""
        row = await s.get(ApiKeyRow, target)
        if row is not None:
            return row
        rows = list(await s.scalars(select(ApiKeyRow).where(ApiKeyRow.name == target)
                                    .order_by(ApiKeyRow.created_at)))
        named = [r for r in rows if r.revoked_at is None] or rows
        if not named:
            raise NotFound(f"no API key {target!r} (neither an id nor a name)")
        if len(named) > 1:
            raise Conflict(f"{len(named)} revoked API keys are named {target!r} "
                           f"({', '.join(r.id for r in named)}): give the id",
                           param="id", code="ambiguous_name")
        return named[0]

    @staticmethod
    async def _refuse_taken(s: AsyncSession, name: str) -> None:
        taken = await s.scalar(select(ApiKeyRow.id).where(
            ApiKeyRow.name == name, ApiKeyRow.revoked_at.is_(None)).limit(1))
        if taken is not None:
            raise Conflict(f"an API key named {name!r} exists already ({taken}); names are "
                           "unique among keys not revoked: choose another name, or revoke that "
                           "key first", param="name", code="duplicate_name")

    @staticmethod
    async def _has_admin(s: AsyncSession) -> bool:
        now = utcnow()
        found = await s.scalar(select(ApiKeyRow.id).where(
            ApiKeyRow.scope == ApiKeyScope.ADMIN.value, ApiKeyRow.revoked_at.is_(None),
            or_(ApiKeyRow.expires_at.is_(None), ApiKeyRow.expires_at > now)).limit(1))
        return found is not None

    async def update(self, req: ApiKeyUpdate) -> ApiKeyPublic:
        async with unit_of_work(self.sessions, f"api key {req.id!r}") as s:
            row = await self.resolve(s, req.id)
            check_version(row.version, req.version, f"api key {row.name!r}")
            if req.scope is not None:
                row.scope = req.scope.value
            if req.limits is not None:
                row.limits = [limit.model_dump(mode="json") for limit in req.limits]
            await s.flush()
            return api_key_public(row)

    async def revoke(self, req: ById) -> ApiKeyPublic:
        async with unit_of_work(self.sessions, f"api key {req.id!r}") as s:
            row = await self.resolve(s, req.id)
            if row.revoked_at is not None:
                raise Conflict(f"api key {row.name!r} is already revoked", code="already_revoked")
            row.revoked_at = utcnow()
            await s.flush()
            return api_key_public(row)

    async def verify(self, req: ApiKeyVerify) -> ApiKeyVerified:
        digest = hash_secret(req.secret)
        async with self.sessions() as s:
            row = await s.scalar(select(ApiKeyRow).where(ApiKeyRow.secret_hash == digest))
        if row is None or not hmac.compare_digest(row.secret_hash, digest):
            return ApiKeyVerified(valid=False)
        expired = row.expires_at is not None and row.expires_at <= utcnow()
        if row.revoked_at is not None or expired:
            return ApiKeyVerified(valid=False, key_id=row.id, name=row.name)
        expires_in = ((row.expires_at - utcnow()).total_seconds() if row.expires_at is not None
                      else None)
        return ApiKeyVerified(valid=True, key_id=row.id, name=row.name,
                              scope=ApiKeyScope(row.scope), has_limits=bool(row.limits),
                              expires_in=expires_in)
