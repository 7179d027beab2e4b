"""Several workers with several GPUs each (pipeline stages across workers, TP within one).

Only when the model allows distribution. Even split first: k workers x g GPUs (TP=g divides the
heads, PP=k), fewest GPUs then fewest workers. When no even split fits, the uneven fallback:
any GPUs across workers with TP=1 and PP=all GPUs. O(W log W) per TP size on this path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.services.scheduler.policies.base import Candidate, PlacementRequest
from shoal.services.scheduler.policies.fleet import FleetIndex, GpuSlot, WorkerSlot
from shoal.services.scheduler.policies.selectors.common import (
    capacities, gpu_candidate, pick_gpus, valid_tp_sizes
)
from shoal.shared.units import fmt_bytes, fmt_count


@dataclass(slots=True)
class _Search:
    note: str | None = None
    caps: dict[str, list[int]] = field(default_factory=dict)
    even: tuple[int, int, int] | None = None
    """(GPUs in all, workers, GPUs per worker) of the best even split."""
    shortfall: tuple[int, int, int, int] | None = None
    """(bytes short per GPU, GPUs, workers, GPUs per worker) of the nearest miss."""


class MultiWorkerSelector:
    name = "multi-worker"

    def search(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None
               ) -> _Search:
        """Capacities per worker, the best even split (n, k, g) and the smallest shortfall."""
        claim = request.gpu_claim
        assert claim is not None
        found = _Search()
        if not request.model.spans_workers():
            found.note = ("Distribution across workers is off for this model "
                          f"({request.model.one_worker_reason()}).")
            return found
        caps = {s.id: capacities(s, request) for s in index.workers
                if (allowed is None or s.id in allowed)}
        found.caps = caps = {wid: c for wid, c in caps.items() if c}
        if len(caps) < 2:
            who = "No eligible worker has" if not caps else "Only 1 eligible worker has"
            found.note = f"{who} a qualifying GPU: no multi-worker combination exists."
            return found
        fixed = request.fixed_parallelism()
        if fixed is not None:
            sizes = [fixed[0]] if fixed[1] >= 2 else []
        else:
            sizes = [1, *valid_tp_sizes(request, max(len(c) for c in caps.values()))]
        for g in sizes:
            ranked = sorted((c[g - 1] for c in caps.values() if len(c) >= g), reverse=True)
            ks = [fixed[1]] if fixed is not None else range(2, min(len(ranked),
                                                                    claim.shape.num_layers) + 1)
            for k in ks:
                if k > len(ranked):
                    continue
                need = claim.per_gpu(g * k)
                if ranked[k - 1] >= need:
                    if found.even is None or (g * k, k) < found.even[:2]:
                        found.even = (g * k, k, g)
                    break
                key = (need - ranked[k - 1], g * k, k, g)
                if found.shortfall is None or key < found.shortfall:
                    found.shortfall = key
        return found

    def select(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None
               ) -> list[Candidate]:
        found = self.search(index, request, allowed)
        if found.even is not None:
            n, k, g = found.even
            return [self._even(index, request, allowed, found.caps, n, k, g)]
        if found.note is None and request.fixed_parallelism() is None:
            uneven = self._uneven(index, request, allowed, found.caps)
            if uneven is not None:
                return [uneven]
        return []

    def explain(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None
                ) -> list[str]:
        found = self.search(index, request, allowed)
        if found.note is not None:
            return [found.note]
        return [self.why_not(request, found.caps, found.shortfall)]

    def _even(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None,
              caps: dict[str, list[int]], n: int, k: int, g: int) -> Candidate:
        assert request.gpu_claim is not None
        need = request.gpu_claim.per_gpu(n)
        chosen: list[tuple[WorkerSlot, list[GpuSlot]]] = []
        for slot in index.ordered("gpu", request.spread):
            c = caps.get(slot.id)
            if c is None or len(c) < g or c[g - 1] < need:
                continue
            gpus = pick_gpus(slot, request, need, g)
            assert gpus is not None
            chosen.append((slot, gpus))
            if len(chosen) == k:
                break
        (main, gpus), stages = chosen[0], chosen[1:]
        return gpu_candidate(main, gpus, request, need, g, k, self.name, stages)

    def _uneven(self, index: FleetIndex, request: PlacementRequest, allowed: set[str] | None,
                caps: dict[str, list[int]]) -> Candidate | None:
        """TP=1, PP=N over the fewest GPUs N (on any workers) that each offer the 1/N share."""
        claim = request.gpu_claim
        assert claim is not None
        ranked = sorted((x for c in caps.values() for x in c), reverse=True)
        total = next((n for n in range(2, min(len(ranked), claim.shape.num_layers) + 1)
                      if ranked[n - 1] >= claim.per_gpu(n)), None)
        if total is None:
            return None
        need = claim.per_gpu(total)
        chosen: list[tuple[WorkerSlot, list[GpuSlot]]] = []
        left = total
        for slot in index.ordered("gpu", request.spread):
            if slot.id not in caps:
                continue
            fitting = sum(1 for x in caps[slot.id] if x >= need)
            if fitting == 0:
                continue
            gpus = pick_gpus(slot, request, need, min(fitting, left))
            assert gpus is not None
            chosen.append((slot, gpus))
            left -= len(gpus)
            if left == 0:
                break
        (main, gpus), stages = chosen[0], chosen[1:]
        return gpu_candidate(main, gpus, request, need, 1, total, self.name + " (uneven)", stages)

    def why_not(self, request: PlacementRequest, caps: dict[str, list[int]],
                shortfall: tuple[int, int, int, int] | None) -> str:
        claim = request.gpu_claim
        assert claim is not None
        ranked = sorted((x for c in caps.values() for x in c), reverse=True)
        everything = len(ranked)
        head = f"Across {len(caps)} workers, {fmt_count(everything, 'GPU')} qualify"
        if shortfall is None:
            text = f"{head}, too few for any even split of workers x GPUs."
        else:
            short, n, k, g = shortfall
            text = (f"{head}. The best multi-worker combination is {k} workers x "
                    f"{fmt_count(g, 'GPU')} (TP={g}, PP={k}): its weakest GPU offers "
                    f"{fmt_bytes(claim.per_gpu(n) - short)}, but the model needs "
                    f"{fmt_bytes(claim.per_gpu(n))} per GPU on {n} GPUs, {fmt_bytes(short)} short.")
        counts = range(2, min(everything, claim.shape.num_layers) + 1)
        uneven = min(((claim.per_gpu(n) - ranked[n - 1], n) for n in counts), default=None)
        if uneven is not None and request.fixed_parallelism() is None:
            short, n = uneven
            text += (f" Even with TP=1 and PP={n} over the {n} largest qualifying GPUs, each "
                     f"needs {fmt_bytes(claim.per_gpu(n))} and the smallest offers "
                     f"{fmt_bytes(ranked[n - 1])}, {fmt_bytes(short)} short.")
        return text
