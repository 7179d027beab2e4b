"""CPU placement by RAM: the first worker in scorer order whose unclaimed RAM holds the claim.

Used when the model is deployed for CPU, or for 'auto' when no eligible worker has a GPU.
"""

from __future__ import annotations

from shoal.services.scheduler.policies.base import Candidate, PlacementRequest
from shoal.services.scheduler.policies.fleet import FleetIndex
from shoal.shared.units import fmt_bytes, fmt_pct


class CpuSelector:
    name = "CPU"

    def select(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None
               ) -> list[Candidate]:
        claim = request.cpu_claim
        assert claim is not None
        need = claim.total
        for slot in index.ordered("ram", request.spread):
            if allowed is not None and slot.id not in allowed:
                continue
            if slot.ram_allocatable >= need:
                return [Candidate(worker=slot, gpu_indexes=[], ram_claim=need, selector=self.name)]
        return []

    def explain(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None
                ) -> list[str]:
        assert request.cpu_claim is not None
        need = request.cpu_claim.total
        eligible = [s for s in index.workers if allowed is None or s.id in allowed]
        if not eligible:
            return ["No eligible worker for a CPU instance."]
        best = max(eligible, key=lambda s: (s.ram_allocatable, s.name))
        return [
            f"No worker has the {fmt_bytes(need)} of RAM the model needs on CPU unclaimed: the "
            f"largest is {best.name} with {fmt_bytes(best.ram_allocatable)} unclaimed of "
            f"{fmt_bytes(best.ram_total)} ({fmt_pct(best.ram_fullness())} claimed), "
            f"{fmt_bytes(need - best.ram_allocatable)} short."
        ]
