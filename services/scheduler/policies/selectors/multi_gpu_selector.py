"""Several GPUs on one worker: the fewest that fit, TP = GPU count (it must divide the heads).

For each valid count n (ascending) the first worker in scorer order with n qualifying GPUs that
each offer the per-GPU share wins. Explicit tp/pp fix n = tp * pp.
"""

from __future__ import annotations

from shoal.services.scheduler.policies.base import Candidate, PlacementRequest
from shoal.services.scheduler.policies.fleet import FleetIndex
from shoal.services.scheduler.policies.selectors.common import (
    capacities, gpu_candidate, pick_gpus, valid_tp_sizes
)
from shoal.shared.units import fmt_bytes


class MultiGpuSelector:
    name = "multi-GPU on one worker"

    def shapes(self, index: FleetIndex, request: PlacementRequest) -> list[tuple[int, int]]:
        """(tp, pp) pairs to try, fewest GPUs first."""
        fixed = request.fixed_parallelism()
        if fixed is not None:
            return [fixed] if fixed[0] * fixed[1] >= 2 else []
        return [(n, 1) for n in valid_tp_sizes(request, index.max_gpus_per_worker)]

    def select(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None
               ) -> list[Candidate]:
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
                    return [gpu_candidate(slot, gpus, request, need, tp, pp, self.name)]
        return []

    def explain(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None
                ) -> list[str]:
        return [self.why_not(index, request, allowed, self.shapes(index, request))]

    def why_not(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None,
                shapes: list[tuple[int, int]]) -> str:
        claim = request.gpu_claim
        assert claim is not None
        s = claim.shape
        if not shapes:
            sizes = [str(n) for n in valid_tp_sizes(request, 1 << 16)] or ["none"]
            most = max((len(w.gpus) for w in index.workers), default=0)
            return (f"No multi-GPU split on one worker is possible: the tensor-parallel size must "
                    f"split the {s.num_attention_heads} attention heads and {s.num_kv_heads} KV "
                    f"heads (divide the heads and the MLP size, and divide the KV heads or be a "
                    f"multiple of them: sizes {', '.join(sizes)}), and the largest worker has "
                    f"{most} GPUs.")
        best: tuple[int, int, str, int, int, int] | None = None  # shortfall, n, name, tp, pp, cap
        most = 0
        for slot in index.workers:
            if allowed is not None and slot.id not in allowed:
                continue
            caps = capacities(slot, request)
            most = max(most, len(caps))
            for tp, pp in shapes:
                n = tp * pp
                if len(caps) < n:
                    continue
                short = claim.per_gpu(n) - caps[n - 1]
                key = (short, n, slot.name, tp, pp, caps[n - 1])
                if best is None or key < best:
                    best = key
        if best is None:
            sizes = [str(tp * pp) for tp, pp in shapes]
            wanted = sizes[0] if len(sizes) == 1 else ", ".join(sizes[:-1]) + " or " + sizes[-1]
            why = ("" if request.fixed_parallelism() else
                   f" (the counts whose tensor-parallel size divides the "
                   f"{s.num_attention_heads} attention heads and {s.num_kv_heads} KV heads)")
            return (f"A multi-GPU split on one worker needs {wanted} qualifying GPUs{why}; "
                    f"the most any eligible worker has is {most}.")
        short, n, name, tp, pp, cap = best
        return (f"The best multi-GPU worker is {name} with {n} qualifying GPUs (TP={tp}, PP={pp}): "
                f"each offers {fmt_bytes(cap)}, but the model needs {fmt_bytes(claim.per_gpu(n))} "
                f"per GPU on {n} GPUs, {fmt_bytes(short)} short.")
