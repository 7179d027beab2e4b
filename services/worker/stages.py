"""The ranks this worker runs for instances whose lead is another worker (pipeline stages).

The lead worker's engine (rank 0) publishes a RankPlan; for each instance that names this worker
among its `subordinate_workers` and is starting or running, the agent asks for the plan and
starts the ranks it gives this worker (rank_process.py, each on its share of the cores:
the engine's RankLaunch and core_shares, as its executor launches them); a vLLM instance's
plan (`executor: ray`) starts this worker's Ray follower instead (ray_follower.py), through
the same flow: asked for, reported on `rank_exits` when it ends unasked, stopped likewise. A rank
that ends on its own is reported on `rank_exits` (rank 0 names it in the instance's ERROR) and
its siblings are stopped; every rank of an instance that left those states, or whose plan is of
an earlier start of rank 0, is stopped. Ranks are children of the agent and exit with it (they
are not adopted: rank 0 then fails and the instance restarts, all ranks with it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from shoal.services.backends.ray_cluster import RAY_EXECUTOR
from shoal.services.engine import RankLaunch, core_shares
from shoal.services.worker.ray_follower import RayFollower
from shoal.shared.bus.client import Bus
from shoal.shared.config import Settings
from shoal.shared.errors import ShoalError
from shoal.shared.schemas.ranks import RankExit, RankPlan, RankPlanRequest
from shoal.shared.schemas.registry import InstancePublic
from shoal.shared.states import InstanceState

log = logging.getLogger(__name__)
STAGE_STATES = frozenset({InstanceState.DOWNLOADING, InstanceState.STARTING,
                          InstanceState.RUNNING})
"""The states in which a subordinate worker runs its ranks (rank 0's engine is up)."""
PLAN_TIMEOUT_S = 2.0
WATCH_EVERY_S = 0.2


@dataclass
class RankGroup:
    """This worker's ranks of one start (generation) of an instance."""

    instance: InstancePublic
    plan: RankPlan
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    log_paths: dict[int, Path] = field(default_factory=dict)
    stopping: bool = False

    def log_tail(self, rank: int, lines: int = 6) -> str:
        try:
            text = self.log_paths[rank].read_text(errors="replace")
        except (OSError, KeyError):
            return ""
        return "\n".join(text.splitlines()[-lines:])[-1500:]


class StageRanks:
    def __init__(self, settings: Settings, bus: Bus, worker_id: str) -> None:
        self.settings = settings
        self.bus = bus
        self.worker_id = worker_id
        self.groups: dict[str, RankGroup | RayFollower] = {}
        self.spent: set[str] = set()
        """Generations whose ranks ended here: never joined again (rank 0 of that start fails)."""
        self._watchers: set[asyncio.Task[None]] = set()

    async def reconcile(self, instances: dict[str, InstancePublic]) -> None:
        """Bring this worker's ranks in line with the instances it is a subordinate of."""
        for instance_id, group in list(self.groups.items()):
            if isinstance(group, RayFollower) and group.ended:  # reported: never joined again
                self.spent.add(group.plan.generation)
                del self.groups[instance_id]
                continue
            inst = instances.get(instance_id)
            if inst is None or inst.state not in STAGE_STATES:
                why = "is gone" if inst is None else f"is {inst.state.value}"
                log.info("instance %s %s: stopping its ranks here", group.instance.name, why)
                await self.stop(instance_id)
        for instance_id, inst in instances.items():
            if inst.state not in STAGE_STATES:
                continue
            group = self.groups.get(instance_id)
            if group is not None and inst.state is InstanceState.RUNNING:
                continue  # a new start of rank 0 passes through STARTING (and needs our ranks)
            plan = await self._plan(inst)
            if plan is None or plan.generation in self.spent:
                continue
            if group is not None and group.plan.generation == plan.generation:
                continue
            if group is not None:  # rank 0 started again: a new rendezvous
                await self.stop(instance_id)
            if plan.config.get("executor") == RAY_EXECUTOR:  # a vLLM instance's Ray cluster
                self.groups[instance_id] = RayFollower(self.settings, self.bus, self.worker_id,
                                                       inst, plan)
            else:
                self.groups[instance_id] = self._start(inst, plan)

    async def _plan(self, inst: InstancePublic) -> RankPlan | None:
        try:
            return await self.bus.request(self.bus.subjects.ranks(inst.id),
                                          RankPlanRequest(worker_id=self.worker_id), RankPlan,
                                          timeout=PLAN_TIMEOUT_S)
        except ShoalError:  # rank 0 has not opened its rendezvous yet (or is gone)
            return None

    def _start(self, inst: InstancePublic, plan: RankPlan) -> RankGroup:
        group = RankGroup(inst, plan)
        ranks = plan.ranks_of(self.worker_id)
        cores = self.settings.worker_cpus or sorted(os.sched_getaffinity(0))
        shares = core_shares(sorted(cores), len(ranks))
        logs = self.settings.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        mine = [s for s in inst.subordinate_workers if s.worker_id == self.worker_id]
        gpus = mine[0].gpu_indexes if mine and plan.config.get("device") != "cpu" else []
        cache = self.settings.model_cache_dir
        for local, (rank, cores) in enumerate(zip(ranks, shares, strict=True)):
            launch = RankLaunch.build(
                rank=rank, config=plan.config, cores=cores, init_method=plan.init_method,
                device=f"cuda:{local}" if gpus else None,
                visible_gpus=tuple(gpus) if gpus else None, instance_id=inst.id,
                cache_dir=str(cache) if cache is not None else None)
            path = group.log_paths[rank] = logs / f"rank-{inst.name}-{rank}.log"
            with open(path, "ab") as out:
                group.procs[rank] = subprocess.Popen(launch.argv(), stdout=out,
                                                     stderr=subprocess.STDOUT,
                                                     env=launch.env(os.environ))
            watcher = asyncio.create_task(self._watch(group, rank), name=f"rank-{rank}")
            self._watchers.add(watcher)
            watcher.add_done_callback(self._watchers.discard)
        log.info("started ranks %s of %s (rendezvous %s, pids %s)", ranks, inst.name,
                 plan.init_method, [p.pid for p in group.procs.values()])
        return group

    async def _watch(self, group: RankGroup, rank: int) -> None:
        """Report a rank that ends unasked, and stop its siblings (the group cannot go on)."""
        proc = group.procs[rank]
        # polled: a thread per rank blocked in wait() would drain the default pool
        while (code := proc.poll()) is None:  # noqa: ASYNC110 - a process, not an event
            await asyncio.sleep(WATCH_EVERY_S)
        if group.stopping:
            return
        self.spent.add(group.plan.generation)
        worker = next(w.worker_name for w in group.plan.workers if w.worker_id == self.worker_id)
        event = RankExit(instance_id=group.instance.id, generation=group.plan.generation,
                         worker_id=self.worker_id, worker_name=worker, rank=rank, code=code,
                         log_tail=group.log_tail(rank))
        log.warning("%s", event.describe())
        try:
            await self.bus.publish(self.bus.subjects.rank_exits(group.instance.id), event)
        except ShoalError as exc:
            log.warning("could not report it: %s", exc.message)
        if self.groups.get(group.instance.id) is group:
            await self.stop(group.instance.id)

    async def stop(self, instance_id: str) -> None:
        group = self.groups.pop(instance_id, None)
        if isinstance(group, RayFollower):
            await group.stop()
        elif group is not None:
            await asyncio.to_thread(stop_group, group)

    def stop_all(self) -> None:
        for instance_id in list(self.groups):
            group = self.groups.pop(instance_id)
            if isinstance(group, RayFollower):
                group.stop_now()
            else:
                stop_group(group)


def stop_group(group: RankGroup, timeout: float = 5.0) -> None:
    """SIGTERM every rank of the group, then SIGKILL what is still there after `timeout`."""
    group.stopping = True
    for proc in group.procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in group.procs.values():
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
