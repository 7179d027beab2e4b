"""The write fence of the scheduler's leader election, checked inside the write's transaction.

A fenced write first takes the barrier lock shared (held until it commits), then checks that the
backend its fence names holds the leader lock and the term's token lock right now. A new leader
takes the barrier exclusively once before it reads anything, so a stale leader's write either
committed before the new leader looked, or sees the new holder and is refused: never both.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from shoal.shared.db.leader_lock import BARRIER_KEY, LEADER_KEY, LOCK_SPACE, NOT_LEADER, TOKEN_SPACE
from shoal.shared.errors import Conflict
from shoal.shared.schemas.registry import LeaderFence

_BARRIER = text("SELECT pg_advisory_xact_lock_shared(:space, :key)")
_HELD = text("""
    SELECT count(*) FROM pg_locks
    WHERE locktype = 'advisory' AND granted AND mode = 'ExclusiveLock' AND objsubid = 2
      AND pid = :pid
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND ((classid = :space AND objid = :leader) OR (classid = :tokens AND objid = :token))
""")


async def check_fence(session: AsyncSession, fence: LeaderFence | None) -> None:
    """Refuse the write (Conflict not_leader) unless `fence` is the current leader's; no fence
    (a worker, the CLI) is not checked. Call it first in the unit of work."""
    if fence is None:
        return
    await session.execute(_BARRIER, {"space": LOCK_SPACE, "key": BARRIER_KEY})
    held = await session.scalar(_HELD, {"pid": fence.pid, "space": LOCK_SPACE, "leader": LEADER_KEY,
                                        "tokens": TOKEN_SPACE, "token": fence.token})
    if held != 2:
        raise Conflict(f"the scheduler behind backend {fence.pid} no longer leads: write refused",
                       code=NOT_LEADER)
