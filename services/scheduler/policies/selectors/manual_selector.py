"""The user's manual GPU selection ("worker-name:gpu-index", ...): validated, never re-chosen.

Overcommit is allowed, but recorded as a warning on the instance. Several workers need
`distributed`; same GPU count per worker gives TP = that count and PP = workers, else TP=1, PP=N.
"""

from __future__ import annotations

from shoal.services.scheduler.policies.base import Candidate, PlacementRequest
from shoal.services.scheduler.policies.fleet import FleetIndex, GpuSlot, WorkerSlot
from shoal.services.scheduler.policies.selectors.common import gpu_candidate
from shoal.shared.units import fmt_bytes, fmt_pct


class ManualGpuSelector:
    name = "manual GPU selection"

    def parse(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None
              ) -> tuple[list[tuple[WorkerSlot, list[GpuSlot]]], list[str]]:
        groups: dict[str, tuple[WorkerSlot, list[GpuSlot]]] = {}
        errors: list[str] = []
        for entry in request.model.gpu_selector:
            name, sep, idx = entry.rpartition(":")
            if not sep or not name or not idx.isdigit():
                errors.append(f"GPU selector {entry!r} is not 'worker-name:gpu-index'.")
                continue
            slot = index.by_name.get(name)
            if slot is None:
                errors.append(f"GPU selector {entry!r} names worker {name!r}, which is not "
                              "registered.")
                continue
            if allowed is not None and slot.id not in allowed:
                errors.append(f"Worker {name} is not eligible (state {slot.worker.state.value}, "
                              f"labels {slot.worker.labels}).")
                continue
            gpu = slot.by_index.get(int(idx))
            if gpu is None:
                have = ", ".join(str(g.index) for g in slot.gpus) or "none"
                errors.append(f"Worker {name} has no GPU {idx} (its GPUs: {have}).")
                continue
            group = groups.setdefault(slot.id, (slot, []))
            if gpu not in group[1]:
                group[1].append(gpu)
        return [(s, sorted(g, key=lambda x: x.index)) for s, g in groups.values()], errors

    def select(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None
               ) -> list[Candidate]:
        candidate, _ = self.decide(index, request, allowed)
        return [] if candidate is None else [candidate]

    def explain(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None
                ) -> list[str]:
        return self.decide(index, request, allowed)[1]

    def decide(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None
               ) -> tuple[Candidate | None, list[str]]:
        claim = request.gpu_claim
        assert claim is not None
        groups, errors = self.parse(index, request, allowed)
        if errors or not groups:
            return None, errors or ["The GPU selection is empty."]
        n = sum(len(g) for _, g in groups)
        counts = {len(g) for _, g in groups}
        if len(groups) > 1 and not request.model.spans_workers():
            return None, [f"The selected GPUs span {len(groups)} workers but the model does not "
                          f"allow distribution ({request.model.one_worker_reason()})."]
        fixed = request.fixed_parallelism()
        if fixed is not None:
            tp, pp = fixed
            if tp * pp != n:
                return None, [f"tp={tp} x pp={pp} needs {tp * pp} GPUs but {n} are selected."]
        elif len(counts) == 1 and claim.valid_tp(counts.pop()):
            tp, pp = len(groups[0][1]), len(groups)
        else:
            tp, pp = 1, n
        need = claim.per_gpu(n)
        warnings = []
        for slot, gpus in groups:
            for gpu in gpus:
                takes = request.gpu_claim_bytes(gpu, need)
                offers = takes if claim.claims_gpu_fraction else gpu.allocatable
                if gpu.allocatable < takes:
                    warnings.append(
                        f"Overcommit: {slot.name} GPU {gpu.index} has {fmt_bytes(gpu.allocatable)} "
                        f"unclaimed ({fmt_pct(gpu.claimed_fraction)} claimed) but the instance "
                        f"claims {fmt_bytes(takes)} of it.")
                if offers < need:
                    warnings.append(
                        f"Overcommit: {slot.name} GPU {gpu.index} offers {fmt_bytes(offers)} but "
                        f"the model needs {fmt_bytes(need)} per GPU on {n} GPU(s).")
        (main, gpus), stages = groups[0], groups[1:]
        candidate = gpu_candidate(main, gpus, request, need, tp, pp, self.name, stages)
        candidate.warnings = warnings
        return candidate, []
