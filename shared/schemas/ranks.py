"""The control plane of an instance whose pipeline stages run on several workers (docs:
architecture "Ranks across workers"). Only who runs which rank, where the rendezvous is, and
which rank died cross the bus: every collective goes over torch.distributed.

The layout is plain arithmetic on the placement, so the scheduler (which claims RAM per worker)
and the engine (which starts the ranks) agree without asking each other.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from shoal.shared.schemas.common import Wire
from shoal.shared.schemas.registry import InstancePublic


class WorkerRanks(Wire):
    """The ranks one worker of an instance runs: whole pipeline stages, tp ranks each."""

    worker_id: str
    worker_name: str
    ranks: list[int]


class RankPlan(Wire):
    """What rank 0's engine answers on `ranks(instance_id)`: enough for a subordinate worker's
    agent to start its ranks and join the process group."""

    instance_id: str
    generation: str
    """New for every start of rank 0: a plan from an engine that has since died is not joined."""
    init_method: str
    """tcp://host:port of rank 0's TCPStore."""
    world_size: int = Field(ge=2)
    workers: list[WorkerRanks]
    config: dict[str, Any]
    """The EngineConfig fields every rank runs with (a rank sets its own threads and device)."""

    def ranks_of(self, worker_id: str) -> list[int]:
        return [r for w in self.workers if w.worker_id == worker_id for r in w.ranks]


class RankPlanRequest(Wire):
    worker_id: str
    """The subordinate worker asking (rank 0's engine logs who joined)."""


class RankExit(Wire):
    """A subordinate worker's rank ended without being asked to (published on
    `rank_exits(instance_id)`): rank 0's engine names it in the instance's ERROR."""

    instance_id: str
    generation: str
    worker_id: str
    worker_name: str
    rank: int
    code: int | None
    log_tail: str = ""
    ray_node: bool = False
    """The worker's Ray follower of a vLLM instance ended (or could not start: code None)."""

    def describe(self) -> str:
        if self.ray_node:
            what = "exited with code" if self.code is not None else "could not start"
            return (f"the Ray follower on worker {self.worker_name} {what}"
                    + (f" {self.code}" if self.code is not None else ""))
        return f"rank {self.rank} on worker {self.worker_name} exited with code {self.code}"


def split_stages(pp: int, num_workers: int) -> list[int]:
    """Pipeline stages per worker, in order, the first ones taking the remainder (the even
    split vLLM gives layers to stages)."""
    base, extra = divmod(pp, num_workers)
    return [base + (1 if i < extra else 0) for i in range(num_workers)]


def rank_layout(instance: InstancePublic) -> list[WorkerRanks]:
    """Which ranks each worker of a placed instance runs, the lead worker first (rank 0).

    Ranks are numbered pp_rank * tp + tp_rank, so a worker running stages [a, b) runs ranks
    [a * tp, b * tp). On GPUs a worker runs as many stages as it has tp-sized groups of GPUs;
    on CPU the stages are split evenly over the workers (`split_stages`).
    """
    assert instance.worker_id is not None, "an instance without a placement has no ranks"
    workers = [(instance.worker_id, instance.worker_name or instance.worker_id,
                len(instance.gpu_indexes))]
    workers += [(s.worker_id, s.worker_name, len(s.gpu_indexes))
                for s in instance.subordinate_workers]
    tp, pp = instance.tp, instance.pp
    stages = [gpus // tp for _, _, gpus in workers]
    if sum(stages) != pp or not all(stages):
        stages = split_stages(pp, len(workers))
    out, start = [], 0
    for (worker_id, name, _), count in zip(workers, stages, strict=True):
        out.append(WorkerRanks(worker_id=worker_id, worker_name=name,
                               ranks=list(range(start * tp, (start + count) * tp))))
        start += count
    return out
