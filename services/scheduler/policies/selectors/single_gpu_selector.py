"""One GPU on one worker: the first worker in scorer order with a qualifying GPU that fits.

O(W) cheap checks (a worker's largest allocatable GPU) plus O(G) on the workers that pass.
"""

from __future__ import annotations

from shoal.services.scheduler.policies.base import Candidate, PlacementRequest
from shoal.services.scheduler.policies.fleet import FleetIndex
from shoal.services.scheduler.policies.selectors.common import (
    describe_gpu, gpu_candidate, pick_gpus, utilization_clause
)
from shoal.shared.units import fmt_bytes


class SingleGpuSelector:
    name = "single GPU"

    def select(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None
               ) -> list[Candidate]:
        claim = request.gpu_claim
        assert claim is not None
        fixed = request.fixed_parallelism()
        if fixed is not None and fixed != (1, 1):
            return []
        need = claim.per_gpu(1)
        for slot in index.ordered("gpu", request.spread):
            if slot.max_gpu_allocatable < need or (allowed is not None and slot.id not in allowed):
                continue
            gpus = pick_gpus(slot, request, need, 1)
            if gpus:
                return [gpu_candidate(slot, gpus, request, need, 1, 1, self.name)]
        return []

    def explain(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None
                ) -> list[str]:
        fixed = request.fixed_parallelism()
        if fixed is not None and fixed != (1, 1):
            return []
        assert request.gpu_claim is not None
        return [self.why_not(index, request, allowed, request.gpu_claim.per_gpu(1))]

    def why_not(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None,
                need: int) -> str:
        best = largest = None
        best_cap = -1
        for slot in index.workers:
            if allowed is not None and slot.id not in allowed:
                continue
            for gpu in slot.gpus:
                if not request.gpu_matches(gpu):
                    continue
                cap = request.gpu_capacity(gpu)
                if cap > best_cap:
                    best, best_cap = (slot, gpu), cap
                if largest is None or gpu.allocatable > largest[1].allocatable:
                    largest = (slot, gpu)
        if largest is None:
            return "No eligible worker has a GPU."
        head = f"No single GPU fits the {fmt_bytes(need)} the model needs on one GPU"
        if best is None or best_cap <= 0:
            claimed = request.gpu_claim is not None and request.gpu_claim.claims_gpu_fraction
            why = f": {utilization_clause(request)}, and none is" if claimed else ""
            return f"{head}{why}. The largest GPU free is {describe_gpu(*largest)}."
        return (f"{head}. The largest qualifying GPU is {describe_gpu(*best)}; it offers "
                f"{fmt_bytes(best_cap)}, {fmt_bytes(need - best_cap)} short.")
