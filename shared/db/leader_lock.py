"""The Postgres advisory locks behind the scheduler's leader election and its write fence.

Shared by the election (services/scheduler/election.py) and the registry's fence check
(services/registry/repo/fencing.py), which must agree on every key. All keys are the two-int4
form, which pg_locks shows as (classid, objid) with objsubid 2. Advisory locks are scoped to one
database: the scheduler must elect in the registry's database, or every fenced write is refused.
"""

from __future__ import annotations

LOCK_SPACE = 0x5340A2
"""classid of the fixed keys (the registry's migration lock is the int8 key 0x5340A1)."""
LEADER_KEY = 1
"""Held, session-level, on the leader's dedicated connection for as long as it leads."""
BARRIER_KEY = 2
"""Fenced writes hold it shared for their transaction; a new leader takes it exclusively once,
after it has the leader lock and before it reads anything, so every write a stale leader had
already got past the check has committed (and is seen) or rolled back."""
TOKEN_SPACE = 0x5340A3
"""classid of each term's token lock (TOKEN_SPACE, random token), held beside the leader lock:
with the backend pid it names one term, so a reused pid cannot pass for a dead leader."""
NOT_LEADER = "not_leader"
"""Conflict code of a write whose fence is not the current leader's."""
