"""Spread: the emptier the candidate's workers, the higher the score (0-100).

Spreads instances over the fleet (fault isolation, less contention).
"""

from __future__ import annotations

from shoal.services.scheduler.policies.base import Candidate
from shoal.services.scheduler.policies.scorers.binpack_scorer import fullness_after


class SpreadScorer:
    name = "spread"

    def score(self, candidate: Candidate) -> float:
        return 100.0 * (1.0 - fullness_after(candidate))
