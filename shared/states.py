"""Instance and worker states and the instance state machine (docs/architecture.md
"Instance state machine").

Plain Python, no I/O: the registry calls `check_transition` before writing, so an illegal move
is refused and nothing is written.
"""

from __future__ import annotations

from enum import Enum

from shoal.shared.errors import Conflict


class InstanceState(str, Enum):
    PENDING = "PENDING"
    SCHEDULED = "SCHEDULED"
    DOWNLOADING = "DOWNLOADING"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    ERROR = "ERROR"
    UNREACHABLE = "UNREACHABLE"


class WorkerState(str, Enum):
    READY = "READY"
    NOT_READY = "NOT_READY"
    DRAINING = "DRAINING"


_S = InstanceState
TRANSITIONS: dict[InstanceState, frozenset[InstanceState]] = {
    # PENDING -> SCHEDULED is a placement; ERROR when the model can never be served.
    _S.PENDING: frozenset({_S.SCHEDULED, _S.ERROR}),
    # Back to PENDING = unscheduled (rescheduling clears the placement).
    _S.SCHEDULED: frozenset({_S.DOWNLOADING, _S.STARTING, _S.PENDING, _S.ERROR, _S.UNREACHABLE}),
    _S.DOWNLOADING: frozenset({_S.STARTING, _S.PENDING, _S.ERROR, _S.UNREACHABLE}),
    _S.STARTING: frozenset({_S.RUNNING, _S.PENDING, _S.ERROR, _S.UNREACHABLE}),
    # RUNNING -> STARTING: the worker restarts a crashed engine.
    _S.RUNNING: frozenset({_S.STARTING, _S.PENDING, _S.ERROR, _S.UNREACHABLE}),
    # ERROR -> DOWNLOADING/STARTING: a restart with back-off; -> PENDING: rescheduled.
    _S.ERROR: frozenset({_S.DOWNLOADING, _S.STARTING, _S.PENDING, _S.UNREACHABLE}),
    # The worker came back: the instance resumes where the worker says it is.
    _S.UNREACHABLE: frozenset(
        {_S.SCHEDULED, _S.DOWNLOADING, _S.STARTING, _S.RUNNING, _S.PENDING, _S.ERROR}
    ),
}

PLACED_STATES = frozenset(s for s in InstanceState if s is not InstanceState.PENDING)
"""States in which an instance holds a placement (and so claims resources)."""


def can_transition(current: InstanceState, target: InstanceState) -> bool:
    return target in TRANSITIONS[current]


def check_transition(current: InstanceState, target: InstanceState) -> None:
    """Raise Conflict when `current -> target` is not in the table."""
    if not can_transition(current, target):
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS[current]))
        raise Conflict(
            f"illegal instance transition {current.value} -> {target.value} "
            f"(allowed from {current.value}: {allowed})",
            code="illegal_transition",
        )
