"""The vocabulary of placement: the request, a candidate, and the seams (filter, selector, scorer).

GPUStack's shape in our words: every stage returns `(items, messages)` so the reasons why nothing
fits accumulate on the way. The seams are Protocols, all synchronous and pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from shoal.services.scheduler.claim import ModelClaim
from shoal.services.scheduler.policies.fleet import FleetIndex, GpuSlot, WorkerSlot
from shoal.shared.schemas.registry import (
    ModelSpec, Placement, PlacementStrategy, ResourceClaim, SubordinateWorker
)


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    """One model to place, with its claims (GPU and/or CPU, depending on its `device`)."""

    model: ModelSpec
    gpu_claim: ModelClaim | None
    cpu_claim: ModelClaim | None
    model_name: str = "the model"

    @property
    def utilization(self) -> float:
        return self.model.gpu_memory_utilization

    @property
    def spread(self) -> bool:
        return self.model.placement_strategy is PlacementStrategy.SPREAD

    def gpu_matches(self, gpu: GpuSlot) -> bool:
        gpu_type = self.model.gpu_type
        return gpu_type is None or gpu_type.lower() in gpu.name.lower()

    def gpu_capacity(self, gpu: GpuSlot) -> int:
        """Bytes this GPU can give one instance of the model; 0 when it does not qualify.

        An LLM takes `gpu_memory_utilization` of the GPU (as vLLM does), so the GPU qualifies only
        when that much is unclaimed; other models take what they need out of what is unclaimed.
        """
        if not self.gpu_matches(gpu):
            return 0
        if self.gpu_claim is not None and self.gpu_claim.claims_gpu_fraction:
            share = int(gpu.total * self.utilization)
            return share if gpu.allocatable >= share else 0
        return gpu.allocatable

    def gpu_claim_bytes(self, gpu: GpuSlot, need: int) -> int:
        """What the instance will claim on this GPU: the vLLM fraction, or just what it needs."""
        if self.gpu_claim is not None and self.gpu_claim.claims_gpu_fraction:
            return int(gpu.total * self.utilization)
        return need

    def fixed_parallelism(self) -> tuple[int, int] | None:
        """(tp, pp) when the model's parameters fix them; the GPU count is then tp * pp."""
        if self.model.tp is None and self.model.pp is None:
            return None
        return (self.model.tp or 1, self.model.pp or 1)


@dataclass(slots=True)
class Stage:
    """One further worker of a multi-worker candidate (pipeline stages)."""

    worker: WorkerSlot
    gpu_indexes: list[int]
    gpu_claims: dict[int, int]
    ram_claim: int = 0
    """On CPU: the RAM of this worker's stages (the weights are split, not copied)."""


@dataclass(slots=True)
class Candidate:
    worker: WorkerSlot
    gpu_indexes: list[int]
    gpu_claims: dict[int, int] = field(default_factory=dict)
    ram_claim: int = 0
    tp: int = 1
    pp: int = 1
    selector: str = ""
    subordinates: list[Stage] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    score: float = 0.0

    @property
    def num_gpus(self) -> int:
        return len(self.gpu_indexes) + sum(len(s.gpu_indexes) for s in self.subordinates)

    def sort_key(self) -> tuple[float, str, list[int]]:
        """Best first: highest score, then worker name, then GPU indexes (deterministic)."""
        return (-self.score, self.worker.name, self.gpu_indexes)

    def to_placement(self) -> Placement:
        return Placement(
            worker_id=self.worker.id, gpu_indexes=list(self.gpu_indexes),
            claim=ResourceClaim(gpu_memory=dict(self.gpu_claims), ram=self.ram_claim),
            tp=self.tp, pp=self.pp, warnings=list(self.warnings),
            subordinate_workers=[
                SubordinateWorker(worker_id=s.worker.id, worker_name=s.worker.name,
                                  gpu_indexes=list(s.gpu_indexes),
                                  claim=ResourceClaim(gpu_memory=dict(s.gpu_claims),
                                                      ram=s.ram_claim))
                for s in self.subordinates
            ],
        )

    def to_log_string(self) -> str:
        where = f"{self.worker.name} GPUs {self.gpu_indexes}" if self.gpu_indexes else (
            f"{self.worker.name} (CPU)")
        for s in self.subordinates:
            where += (f" + {s.worker.name} GPUs {s.gpu_indexes}" if s.gpu_indexes
                      else f" + {s.worker.name} (CPU)")
        return f"{where}, TP={self.tp} PP={self.pp}, score {self.score:.1f} ({self.selector})"


class WorkerFilter(Protocol):
    def filter(self, workers: list[WorkerSlot], request: PlacementRequest
               ) -> tuple[list[WorkerSlot], list[str]]: ...


class CandidateSelector(Protocol):
    """`select` is the hot path (stops at the first fit in scorer order); `explain` gives the
    numbers of why nothing fits, and runs only when every selector came back empty."""

    name: str

    def select(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None
               ) -> list[Candidate]: ...

    def explain(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None
                ) -> list[str]: ...


class CandidateScorer(Protocol):
    def score(self, candidate: Candidate) -> float: ...
