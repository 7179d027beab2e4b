"""The model's gpu_type: keep workers with at least one GPU whose name contains it.

Only for GPU placements; the selectors also skip non-matching GPUs on a kept worker.
"""

from __future__ import annotations

from shoal.services.scheduler.policies.base import PlacementRequest
from shoal.services.scheduler.policies.fleet import WorkerSlot


class GpuTypeFilter:
    def filter(self, workers: list[WorkerSlot], request: PlacementRequest
               ) -> tuple[list[WorkerSlot], list[str]]:
        gpu_type = request.model.gpu_type
        if not gpu_type:
            return workers, []
        kept = [w for w in workers if any(request.gpu_matches(g) for g in w.gpus)]
        return kept, [f"Matched {len(kept)}/{len(workers)} workers by GPU type {gpu_type!r}."]
