"""The placement fence (shared/placement_fence.py): a write naming an earlier placement of an
instance is refused with a reason; one naming the current placement, or none, goes through."""

from __future__ import annotations

import pytest

from shoal.shared.errors import Conflict
from shoal.shared.placement_fence import STALE_PLACEMENT, check_placement


@pytest.mark.parametrize("current,claimed", [(7, 7), (0, 0), (None, None), (7, None)])
def test_the_current_placement_or_no_claim_passes(current: int | None,
                                                  claimed: int | None) -> None:
    check_placement("instance 'a'", current, claimed)


@pytest.mark.parametrize("current,claimed,says", [
    (9, 3, "placed anew (generation 9)"),
    (None, 3, "is not placed now"),
])
def test_an_earlier_placement_is_refused_with_why(current: int | None, claimed: int,
                                                  says: str) -> None:
    with pytest.raises(Conflict) as err:
        check_placement("instance 'a'", current, claimed)
    assert err.value.code == STALE_PLACEMENT and err.value.http_status == 409
    assert says in err.value.message and "generation 3" in err.value.message
