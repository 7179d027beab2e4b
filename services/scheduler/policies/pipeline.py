"""The placement pipeline: filter -> select (first non-empty wins) -> score -> pick, with reasons.

`SchedulingPipeline.place(index, request)` decides one instance; it does not change the index:
the caller applies the placement (`index.apply`) once the registry accepted it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.services.scheduler.claim import ModelClaim
from shoal.services.scheduler.policies.base import (
    Candidate, CandidateScorer, CandidateSelector, PlacementRequest, WorkerFilter
)
from shoal.services.scheduler.policies.filters import GpuTypeFilter, LabelFilter, StatusFilter
from shoal.services.scheduler.policies.fleet import FleetIndex, WorkerSlot
from shoal.services.scheduler.policies.scorers import BinpackScorer, SpreadScorer
from shoal.services.scheduler.policies.selectors import (
    CpuSelector, ManualGpuSelector, MultiGpuSelector, MultiWorkerSelector, SingleGpuSelector
)
from shoal.shared.schemas.registry import DeviceKind, Placement
from shoal.shared.units import fmt_bytes


@dataclass(slots=True)
class PlacementResult:
    """A placement, or why there is none (`messages`, plain sentences with numbers)."""

    placement: Placement | None
    candidate: Candidate | None
    claim: ModelClaim | None
    """The claim the decision used (GPU or CPU)."""
    messages: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.placement is not None

    @property
    def reason(self) -> str:
        """The PENDING message: what the model needs, then why nothing fits."""
        parts = [self.claim.describe()] if self.claim is not None else []
        return " ".join(parts + self.messages)

    def describe(self) -> str:
        if self.candidate is None:
            return "No placement. " + self.reason
        c = self.candidate
        text = f"Placement: {c.to_log_string()}."
        parts = [f"{fmt_bytes(b)} of {w.name} GPU {i}" for w, claims in
                 [(c.worker, c.gpu_claims)] + [(s.worker, s.gpu_claims) for s in c.subordinates]
                 for i, b in sorted(claims.items())]
        if c.ram_claim:
            parts.append(f"{fmt_bytes(c.ram_claim)} of {c.worker.name}'s RAM")
        parts += [f"{fmt_bytes(s.ram_claim)} of {s.worker.name}'s RAM" for s in c.subordinates
                  if s.ram_claim]
        text += f" It claims {', '.join(parts)}."
        if self.claim is not None:
            text += " " + self.claim.describe()
        for warning in self.candidate.warnings:
            text += " " + warning
        return text


class SchedulingPipeline:
    def __init__(self) -> None:
        self.filters: list[WorkerFilter] = [StatusFilter(), LabelFilter()]
        self.gpu_filters: list[WorkerFilter] = [GpuTypeFilter()]
        self.manual: CandidateSelector = ManualGpuSelector()
        self.gpu_selectors: list[CandidateSelector] = [
            SingleGpuSelector(), MultiGpuSelector(), MultiWorkerSelector()]
        self.cpu_selector: CandidateSelector = CpuSelector()
        self.scorers: dict[bool, CandidateScorer] = {False: BinpackScorer(), True: SpreadScorer()}

    def place(self, index: FleetIndex, request: PlacementRequest) -> PlacementResult:
        use_gpu, workers, allowed, notes = self.eligible(index, request)
        messages = list(notes)
        claim = request.gpu_claim if use_gpu else request.cpu_claim
        if claim is None:
            return PlacementResult(None, None, None, messages + ["The model has no claim for "
                                                                 "this device."])
        if not workers:
            messages.append("No worker is eligible.")
            return PlacementResult(None, None, claim, messages)
        if not use_gpu:
            selectors = [self.cpu_selector]
        elif request.model.gpu_selector:
            selectors = [self.manual]
        else:
            selectors = self.gpu_selectors
        for selector in selectors:
            candidates = selector.select(index, request, allowed)
            if candidates:
                best = self.pick(candidates, request)
                return PlacementResult(best.to_placement(), best, claim, messages)
        for selector in selectors:
            messages += selector.explain(index, request, allowed)
        return PlacementResult(None, None, claim, messages)

    def eligible(self, index: FleetIndex, request: PlacementRequest
                 ) -> tuple[bool, list[WorkerSlot], set[str] | None, list[str]]:
        """Run the filters once per request signature and snapshot (then O(1) per placement).

        Returns whether to place on GPUs, the eligible workers, their ids (None = all) and the
        filters' messages.
        """
        model = request.model
        key = (model.device, tuple(sorted(model.worker_selector.items())), model.gpu_type,
               bool(model.gpu_selector))
        cached = index.filtered.get(key)
        if cached is None:
            messages: list[str] = []
            workers = index.workers
            for f in self.filters:
                workers, notes = f.filter(workers, request)
                messages += notes
            if self._use_gpu(request, workers):
                for f in self.gpu_filters:
                    workers, notes = f.filter(workers, request)
                    messages += notes
            allowed = None if len(workers) == len(index.workers) else {w.id for w in workers}
            cached = index.filtered[key] = (workers, allowed, messages)
        workers, allowed, messages = cached
        return self._use_gpu(request, workers), workers, allowed, messages

    def pick(self, candidates: list[Candidate], request: PlacementRequest) -> Candidate:
        scorer = self.scorers[request.spread]
        for c in candidates:
            c.score = scorer.score(c)
        return min(candidates, key=Candidate.sort_key)

    @staticmethod
    def _use_gpu(request: PlacementRequest, workers: list[WorkerSlot]) -> bool:
        device = request.model.device
        if device is DeviceKind.CPU:
            return False
        if device is DeviceKind.GPU or request.model.gpu_selector or request.model.gpu_type:
            return True
        return any(w.gpus for w in workers)
