"""Binpack: the fuller the candidate's workers end up, the higher the score (0-100).

Keeps whole workers and GPUs free for large models. The FleetIndex's binpack order (fullest
worker first) is this score's order, so selectors may stop at the first fit.
"""

from __future__ import annotations

from shoal.services.scheduler.policies.base import Candidate


def fullness_after(candidate: Candidate) -> float:
    """Claimed fraction of the candidate's workers (GPU memory, or RAM for CPU) once placed."""
    if not candidate.gpu_indexes:
        w = candidate.worker
        return (w.ram_allocated + candidate.ram_claim) / w.ram_total if w.ram_total else 1.0
    workers = [(candidate.worker, candidate.gpu_claims)]
    workers += [(s.worker, s.gpu_claims) for s in candidate.subordinates]
    total = sum(w.gpu_total for w, _ in workers)
    used = sum(w.gpu_allocated + sum(c.values()) for w, c in workers)
    return min(1.0, used / total) if total else 1.0


class BinpackScorer:
    name = "binpack"

    def score(self, candidate: Candidate) -> float:
        return 100.0 * fullness_after(candidate)
