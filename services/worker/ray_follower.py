"""This worker's Ray follower for a vLLM instance that another worker leads (its plan's config
says `executor: ray`: services/backends/ray_cluster.py). The follower runs from the same vLLM
venv as the head (its Ray workers import vLLM), installed here on first use, with Ray added;
`ray start --block --address=HEAD` then joins the head's GCS with this worker's share of the
ranks (`--num-cpus` on CPU, its claimed GPUs on a GPU worker). A follower that ends unasked, or
that cannot be installed or started, is reported on `rank_exits` with its log's tail (the
instance's adapter moves it to ERROR); StageRanks stops it when the instance leaves the states
its stages run in, or when the head's plan is of a new start.
"""

from __future__ import annotations

import asyncio
import logging

from shoal.services.backends.args import ray_start
from shoal.services.backends.ray_cluster import (
    RayNode, free_port_range, node_host, spawn_node
)
from shoal.services.backends.venv import ensure_ray, vllm_python
from shoal.shared.bus.client import Bus
from shoal.shared.config import Settings
from shoal.shared.errors import ShoalError
from shoal.shared.schemas.ranks import RankExit, RankPlan
from shoal.shared.schemas.registry import InstancePublic

log = logging.getLogger(__name__)
WATCH_EVERY_S = 0.2


class RayFollower:
    """One instance's follower on this worker: installed, started and watched by a task."""

    def __init__(self, settings: Settings, bus: Bus, worker_id: str, instance: InstancePublic,
                 plan: RankPlan) -> None:
        self.settings = settings
        self.bus = bus
        self.worker_id = worker_id
        self.instance = instance
        self.plan = plan
        self.node: RayNode | None = None
        self.stopping = False
        self.ended = False
        """It ended (or failed to start) unasked and was reported: its plan is never joined
        again (the head fails the instance, which starts over with a new plan)."""
        self.log_path = settings.data_dir / "logs" / f"ray-follower-{instance.name}.log"
        self.task = asyncio.create_task(self._run(), name=f"ray-follower-{instance.name}")

    async def _run(self) -> None:
        try:
            self.node = await asyncio.to_thread(self._start)
        except Exception as exc:  # noqa: BLE001 - reported to the instance's adapter
            message = exc.message if isinstance(exc, ShoalError) else f"{type(exc).__name__}: {exc}"
            log.warning("cannot start the Ray follower of %s: %s", self.instance.name, message)
            await self._report(None, message[-1500:])
            return
        if self.stopping:  # stopped while it was being installed or started
            await asyncio.to_thread(self.node.stop)
            return
        log.info("started the Ray follower of %s (pid %d, joins %s, log %s)", self.instance.name,
                 self.node.process.pid, self.plan.config["head"], self.log_path)
        while (code := self.node.process.poll()) is None:  # noqa: ASYNC110 - a process
            await asyncio.sleep(WATCH_EVERY_S)
        if not self.stopping:
            log.warning("the Ray follower of %s exited with %s", self.instance.name, code)
            await self._report(code, self.node.tail())

    def _start(self) -> RayNode:
        config = self.plan.config
        device = str(config.get("device", "cpu"))
        python = vllm_python(self.settings, device, str(config["version"]),
                             lambda line: log.info("%s", line))
        ray = ensure_ray(python, lambda line: log.info("%s", line))
        if self.stopping:
            raise ShoalError("stopped while installing")
        host = node_host(self.settings)
        mine = [s for s in self.instance.subordinate_workers if s.worker_id == self.worker_id]
        gpus = tuple(mine[0].gpu_indexes) if mine and device == "gpu" else ()
        ranks = len(self.plan.ranks_of(self.worker_id))
        command = ray_start(str(ray), host, free_port_range(host), head=str(config["head"]),
                            num_cpus=ranks if device == "cpu" else None, gpu_indexes=gpus,
                            env={str(k): str(v) for k, v in dict(config.get("env", {})).items()})
        return spawn_node(command, self.log_path, "follower",
                          self.settings.data_dir / "backends" / self.instance.name)

    async def _report(self, code: int | None, tail: str) -> None:
        self.ended = True
        worker = next((w.worker_name for w in self.plan.workers if w.worker_id == self.worker_id),
                      self.worker_id)
        ranks = self.plan.ranks_of(self.worker_id)
        event = RankExit(instance_id=self.instance.id, generation=self.plan.generation,
                         worker_id=self.worker_id, worker_name=worker,
                         rank=ranks[0] if ranks else -1, code=code, log_tail=tail,
                         ray_node=True)
        try:
            await self.bus.publish(self.bus.subjects.rank_exits(self.instance.id), event)
        except ShoalError as exc:
            log.warning("could not report it: %s", exc.message)

    def stop_now(self) -> None:
        """Stop the follower (its node's processes with it); blocking."""
        self.stopping = True
        if self.node is not None:
            self.node.stop()

    async def stop(self) -> None:
        """Stop it; its task ends once the node has (or, still installing, when that is
        over: the node it then starts is stopped at once)."""
        self.stopping = True
        await asyncio.to_thread(self.stop_now)
