"""The instance state machine, as docs/architecture.md draws it."""

from __future__ import annotations

import pytest

from shoal.shared.errors import Conflict
from shoal.shared.states import TRANSITIONS, InstanceState as S, can_transition, check_transition

HAPPY_PATH = [S.PENDING, S.SCHEDULED, S.DOWNLOADING, S.STARTING, S.RUNNING]


def test_happy_path_is_allowed() -> None:
    for current, target in zip(HAPPY_PATH, HAPPY_PATH[1:]):
        check_transition(current, target)


@pytest.mark.parametrize("current,target", [
    (S.PENDING, S.RUNNING), (S.PENDING, S.DOWNLOADING), (S.PENDING, S.UNREACHABLE),
    (S.SCHEDULED, S.RUNNING), (S.DOWNLOADING, S.RUNNING), (S.RUNNING, S.DOWNLOADING),
    (S.RUNNING, S.SCHEDULED), (S.ERROR, S.RUNNING),
])
def test_illegal_moves_are_refused(current: S, target: S) -> None:
    assert not can_transition(current, target)
    with pytest.raises(Conflict) as err:
        check_transition(current, target)
    assert err.value.code == "illegal_transition" and current.value in err.value.message


def test_every_state_can_fail_or_be_rescheduled() -> None:
    for state in S:
        if state is not S.PENDING:
            assert can_transition(state, S.PENDING), state  # rescheduling
        if state is not S.ERROR:
            assert can_transition(state, S.ERROR), state
    assert set(TRANSITIONS) == set(S)


def test_unreachable_resumes_where_the_worker_is() -> None:
    for target in (S.SCHEDULED, S.DOWNLOADING, S.STARTING, S.RUNNING):
        assert can_transition(S.UNREACHABLE, target)
