"""The fence of a placement: a worker's or an engine's write names the placement it serves
(its generation), and is refused once the instance was placed anew or unplaced since.

Why: a worker cut off by a partition still runs its engine; meanwhile the instance goes
UNREACHABLE, back to PENDING and is placed on another worker. When the network heals, the old
engine (or its supervisor) must not move the replica that now runs elsewhere: without this its
"RUNNING" or "ERROR" would land on the new placement's row. Pure, so unit-tested.
"""

from __future__ import annotations

from shoal.shared.errors import Conflict

STALE_PLACEMENT = "stale_placement"


def check_placement(what: str, current: int | None, claimed: int | None) -> None:
    """Refuse (Conflict stale_placement) a write that names placement `claimed` when the
    instance's placement is now `current` (None: not placed). `claimed` None: not checked (the
    scheduler, an administrator)."""
    if claimed is None or claimed == current:
        return
    now = "is not placed now" if current is None else f"was placed anew (generation {current})"
    raise Conflict(f"{what} {now}: this write comes from its placement of generation {claimed}, "
                   "an engine that has been replaced; write refused", code=STALE_PLACEMENT)
