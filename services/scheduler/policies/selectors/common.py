"""Helpers the GPU selectors share: qualifying capacities, GPU picking, valid TP sizes."""

from __future__ import annotations


from shoal.services.engine import valid_tp_sizes as engine_tp_sizes
from shoal.services.scheduler.policies.base import Candidate, PlacementRequest, Stage
from shoal.services.scheduler.policies.fleet import GpuSlot, WorkerSlot
from shoal.shared.units import fmt_bytes, fmt_pct


def valid_tp_sizes(request: PlacementRequest, upto: int) -> list[int]:
    """TP sizes >= 2, up to `upto`, that split the model (the engine's rule: model_limits.py)."""
    assert request.gpu_claim is not None
    s = request.gpu_claim.shape
    return [n for n in engine_tp_sizes(s.num_attention_heads, s.num_kv_heads,
                                       s.mlp_split_size) if 2 <= n <= upto]


def capacities(slot: WorkerSlot, request: PlacementRequest) -> list[int]:
    """What each qualifying GPU of the worker offers this model, largest first."""
    caps = [request.gpu_capacity(g) for g in slot.gpus]
    return sorted((c for c in caps if c > 0), reverse=True)


def pick_gpus(slot: WorkerSlot, request: PlacementRequest, need: int, n: int
              ) -> list[GpuSlot] | None:
    """n GPUs of the worker that each offer `need`: fullest first (binpack) or emptiest (spread)."""
    fits = [g for g in slot.gpus if request.gpu_capacity(g) >= need]
    if len(fits) < n:
        return None
    if request.spread:
        fits.sort(key=lambda g: (-g.allocatable, g.index))
    else:
        fits.sort(key=lambda g: (g.allocatable, g.index))
    return sorted(fits[:n], key=lambda g: g.index)


def claims_of(gpus: list[GpuSlot], request: PlacementRequest, need: int) -> dict[int, int]:
    return {g.index: request.gpu_claim_bytes(g, need) for g in gpus}


def gpu_candidate(slot: WorkerSlot, gpus: list[GpuSlot], request: PlacementRequest, need: int,
                  tp: int, pp: int, selector: str, stages: list[tuple[WorkerSlot, list[GpuSlot]]]
                  | None = None) -> Candidate:
    subordinates = [Stage(worker=w, gpu_indexes=[g.index for g in gs],
                          gpu_claims=claims_of(gs, request, need)) for w, gs in (stages or [])]
    return Candidate(worker=slot, gpu_indexes=[g.index for g in gpus],
                     gpu_claims=claims_of(gpus, request, need), tp=tp, pp=pp, selector=selector,
                     subordinates=subordinates)


def describe_gpu(slot: WorkerSlot, gpu: GpuSlot) -> str:
    """'w1 GPU 0 (H100, 80.0 GiB): 10% claimed, 72.0 GiB unclaimed'."""
    return (f"{slot.name} GPU {gpu.index} ({gpu.name}, {fmt_bytes(gpu.total)}): "
            f"{fmt_pct(gpu.claimed_fraction)} claimed, {fmt_bytes(gpu.allocatable)} unclaimed")


def utilization_clause(request: PlacementRequest) -> str:
    u = request.utilization
    return (f"with gpu_memory_utilization {u:g} an instance takes {fmt_pct(u)} of each GPU it "
            f"uses, so a GPU qualifies only if {fmt_pct(u)} of it is unclaimed")
