"""Candidate scorers: binpack (fullest worker first, the default) and spread."""

from __future__ import annotations

from shoal.services.scheduler.policies.scorers.binpack_scorer import BinpackScorer, fullness_after
from shoal.services.scheduler.policies.scorers.spread_scorer import SpreadScorer

__all__ = ["BinpackScorer", "SpreadScorer", "fullness_after"]
