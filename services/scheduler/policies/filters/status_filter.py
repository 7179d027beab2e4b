"""Only READY workers take new instances (NOT_READY and DRAINING do not); simulated ones count."""

from __future__ import annotations

from shoal.services.scheduler.policies.base import PlacementRequest
from shoal.services.scheduler.policies.fleet import WorkerSlot
from shoal.shared.states import WorkerState


class StatusFilter:
    def filter(self, workers: list[WorkerSlot], request: PlacementRequest
               ) -> tuple[list[WorkerSlot], list[str]]:
        kept = [w for w in workers if w.worker.state is WorkerState.READY]
        if len(kept) == len(workers):
            return workers, []
        return kept, [f"Matched {len(kept)}/{len(workers)} workers by READY status."]
