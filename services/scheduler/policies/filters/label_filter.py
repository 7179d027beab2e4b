"""The model's worker_selector: a worker must carry every label with the same value."""

from __future__ import annotations

from shoal.services.scheduler.policies.base import PlacementRequest
from shoal.services.scheduler.policies.fleet import WorkerSlot


class LabelFilter:
    def filter(self, workers: list[WorkerSlot], request: PlacementRequest
               ) -> tuple[list[WorkerSlot], list[str]]:
        selector = request.model.worker_selector
        if not selector:
            return workers, []
        wanted = selector.items()
        kept = [w for w in workers if wanted <= w.worker.labels.items()]
        labels = ", ".join(f"{k}={v}" for k, v in sorted(selector.items()))
        return kept, [f"Matched {len(kept)}/{len(workers)} workers by labels {labels}."]
