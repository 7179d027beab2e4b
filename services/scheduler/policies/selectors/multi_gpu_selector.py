"""Several GPUs on one worker: the fewest that fit, TP = GPU count (it must divide the heads).

For each valid count n (ascending) the first worker in scorer order with n qualifying GPUs that
each offer the per-GPU share wins. Explicit tp/pp fix n = tp * pp.
"""

from __future__ import annotations

from shoal.services.scheduler.policies.base import Candidate, PlacementRequest
from shoal.services.scheduler.policies.fleet import FleetIndex
from shoal.services.scheduler.policies.selectors.common import (
    capacities,
    gpu_candidate,
    pick_gpus,
    valid_tp_sizes,
)
from shoal.services.scheduler.units import fmt_bytes


class MultiGpuSelector:
    name = "multi-GPU on one worker"

    def shapes(self, index: FleetIndex, request: PlacementRequest) -> list[tuple[int, int]]:
        """(tp, pp) pairs to try, fewest GPUs first."""
        fixed = request.fixed_parallelism()
        if fixed is not None:
            return [fixed] if fixed[0] * fixed[1] >= 2 else []
        most = max((len(s.gpus) for s in index.workers), default=0)
        return [(n, 1) for n in valid_tp_sizes(request, most)]

    def select(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None
               ) -> tuple[list[Candidate], list[str]]:
        claim = request.gpu_claim
        assert claim is not None
        shapes = self.shapes(index, request)
        for tp, pp in shapes:
            n = tp * pp
            need = claim.per_gpu(n)
            for slot in index.ordered("gpu", request.spread):
                if (len(slot.gpus) < n or slot.max_gpu_allocatable < need
                        or (allowed is not None and slot.id not in allowed)):
                    continue
                gpus = pick_gpus(slot, request, need, n)
                if gpus:
                    return [gpu_candidate(slot, gpus, request, need, tp, pp, self.name)], []
        return [], [self.why_not(index, request, allowed, shapes)]

    def why_not(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None,
                shapes: list[tuple[int, int]]) -> str:
        claim = request.gpu_claim
        assert claim is not None
        s = claim.shape
        if not shapes:
            return (f"No multi-GPU split is possible: the tensor-parallel size must divide the "
                    f"{s.num_attention_heads} attention heads and {s.num_kv_heads} KV heads, "
                    f"and no worker has that many GPUs.")
        best: tuple[int, int, str, int, int, int] | None = None  # shortfall, n, name, tp, pp, cap
        for slot in index.workers:
            if allowed is not None and slot.id not in allowed:
                continue
            caps = capacities(slot, request)
            for tp, pp in shapes:
                n = tp * pp
                if len(caps) < n:
                    continue
                short = claim.per_gpu(n) - caps[n - 1]
                key = (short, n, slot.name, tp, pp, caps[n - 1])
                if best is None or key < best:
                    best = key
        sizes = ", ".join(str(tp * pp) for tp, pp in shapes)
        if best is None:
            return (f"No worker has {sizes} qualifying GPUs (the GPU counts whose tensor-parallel "
                    f"size divides the {s.num_attention_heads} attention heads and "
                    f"{s.num_kv_heads} KV heads).")
        short, n, name, tp, pp, cap = best
        return (f"The best multi-GPU worker is {name} with {n} qualifying GPUs (TP={tp}, PP={pp}): "
                f"each offers {fmt_bytes(cap)}, but the model needs {fmt_bytes(claim.per_gpu(n))} "
                f"per GPU on {n} GPUs, {fmt_bytes(short)} short.")
