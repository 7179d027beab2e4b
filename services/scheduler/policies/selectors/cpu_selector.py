"""CPU placement by RAM: the first worker in scorer order whose unclaimed RAM holds the claim.

Used when the model is deployed for CPU, or for 'auto' when no eligible worker has a GPU. With
tp / pp fixed, the instance runs tp x pp engine ranks on that worker, which split its cores: the
worker needs at least one core per rank. The weights are split, not copied, so the claim is the
model's whole claim whatever the ranks.
"""

from __future__ import annotations

from shoal.services.scheduler.policies.base import Candidate, PlacementRequest
from shoal.services.scheduler.policies.fleet import FleetIndex, WorkerSlot
from shoal.shared.units import fmt_bytes, fmt_pct


class CpuSelector:
    name = "CPU"

    def select(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None
               ) -> list[Candidate]:
        claim = request.cpu_claim
        assert claim is not None
        need = claim.total
        tp, pp = request.fixed_parallelism() or (1, 1)
        for slot in index.ordered("ram", request.spread):
            if allowed is not None and slot.id not in allowed:
                continue
            if slot.ram_allocatable >= need and _cores(slot) >= tp * pp:
                return [Candidate(worker=slot, gpu_indexes=[], ram_claim=need, tp=tp, pp=pp,
                                  selector=self.name)]
        return []

    def explain(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None
                ) -> list[str]:
        assert request.cpu_claim is not None
        need = request.cpu_claim.total
        eligible = [s for s in index.workers if allowed is None or s.id in allowed]
        if not eligible:
            return ["No eligible worker for a CPU instance."]
        tp, pp = request.fixed_parallelism() or (1, 1)
        ranks = tp * pp
        if ranks > 1:
            roomy = [s for s in eligible if s.ram_allocatable >= need]
            if roomy:
                most = max(roomy, key=lambda s: (_cores(s), s.name))
                return [f"tp={tp} x pp={pp} runs {ranks} engine ranks, one CPU core each at "
                        f"least: the worker with the most cores and the RAM free, {most.name}, "
                        f"has {_cores(most)}."]
        best = max(eligible, key=lambda s: (s.ram_allocatable, s.name))
        return [
            f"No worker has the {fmt_bytes(need)} of RAM the model needs on CPU unclaimed: the "
            f"largest is {best.name} with {fmt_bytes(best.ram_allocatable)} unclaimed of "
            f"{fmt_bytes(best.ram_total)} ({fmt_pct(best.ram_fullness())} claimed), "
            f"{fmt_bytes(need - best.ram_allocatable)} short."
        ]


def _cores(slot: WorkerSlot) -> int:
    return slot.worker.status.cpu_cores
