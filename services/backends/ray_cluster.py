"""The Ray cluster of one vLLM instance placed across workers, run as GPUStack's VLLMServer runs
it: a Ray head on the main worker (started by the instance's adapter, its GCS up before anyone
joins), a follower (`ray start --address=HEAD`) on each subordinate worker, then vLLM's server
on the main worker with `--distributed-executor-backend ray`.

The followers reuse the control plane of our own engine's ranks across workers
(shared/schemas/ranks.py): the adapter answers `ranks(instance_id)` with a RankPlan whose
config says `executor: ray` and names the head; a subordinate's agent (worker/ray_follower.py)
installs the same vLLM and Ray, starts its follower, and reports one that ends on its own on
`rank_exits(instance_id)`, which fails the instance (ERROR with the follower's log tail). The
head dies with the adapter; a follower with its agent, or when the instance leaves the states
it is served in.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shoal.services.backends.args import RAY_PORTS, RAY_WORKER_PORTS, Command
from shoal.shared.bus.client import Bus
from shoal.shared.bus.codec import encode
from shoal.shared.config import Settings
from shoal.shared.errors import ShoalError
from shoal.shared.process import die_with_parent
from shoal.shared.schemas.ranks import RankExit, RankPlan, rank_layout
from shoal.shared.schemas.registry import InstancePublic

RAY_EXECUTOR = "ray"
"""RankPlan.config["executor"] of a vLLM instance's Ray cluster (our engine's plans have none)."""
GCS_TIMEOUT_S = 60.0
STOP_WAIT_S = 5.0


def node_host(settings: Settings) -> str:
    """The address this worker's Ray node (and vLLM) listens on: `distributed_host`, else
    127.0.0.1 for a stack on one machine, else the metrics host."""
    if settings.distributed_host:
        return settings.distributed_host
    local = settings.metrics_host in ("127.0.0.1", "localhost")
    return "127.0.0.1" if local else settings.metrics_host


def free_port_range(host: str, count: int = RAY_PORTS + RAY_WORKER_PORTS + 1) -> int:
    """A start port whose `count` ports are all free on `host` now (a Ray node's range)."""
    for _ in range(200):
        start = random.randrange(20000, 60000 - count)
        if all(_free(host, port) for port in range(start, start + count)):
            return start
    raise ShoalError(f"no {count} free consecutive ports on {host} for a Ray node")


def _free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@dataclass
class RayNode:
    """One `ray start --block` process (its own process group: the raylet, GCS and workers it
    starts go with it)."""

    process: subprocess.Popen[bytes]
    log_path: Path
    role: str

    def tail(self, lines: int = 12) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])[-1500:]

    def exited(self) -> str | None:
        code = self.process.poll()
        if code is None:
            return None
        return f"the Ray {self.role} exited with {code}: {self.tail()}"

    def stop(self) -> None:
        """SIGTERM to the node's group (`ray start --block` stops its node on it), SIGKILL to
        whatever is left after STOP_WAIT_S."""
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        for _ in range(10):  # again: a raylet being killed may just have forked a worker
            self._signal(signal.SIGKILL)
            time.sleep(0.1)
        self.process.wait()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def spawn_node(command: Command, log_path: Path, role: str, cwd: Path | None = None) -> RayNode:
    """Start a Ray node as a child that dies with its parent."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if cwd is not None:
        cwd.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "RAY_ADDRESS"))}
    env.update(command.env)
    with open(log_path, "ab") as out:
        process = subprocess.Popen(command.argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   cwd=cwd, preexec_fn=die_with_parent, start_new_session=True)
    return RayNode(process, log_path, role)


async def wait_gcs(node: RayNode, host: str, port: int, timeout: float = GCS_TIMEOUT_S) -> None:
    """Until the head's GCS accepts connections (followers may join then); ShoalError if the
    head ends first or the GCS is not up after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (exited := node.exited()) is not None:
            raise ShoalError(exited)
        try:
            _reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 1.0)
        except (OSError, TimeoutError):
            await asyncio.sleep(0.2)
            continue
        writer.close()
        return
    raise ShoalError(f"the Ray head's GCS at {host}:{port} is not up after {timeout:.0f} s: "
                     f"{node.tail()}")


def ray_plan(instance: InstancePublic, head: str, package: str, version: str, device: str,
             env: dict[str, str]) -> RankPlan:
    """What a subordinate's agent reads to start its follower: the head's GCS address and the
    vLLM (package, version) whose venv runs it (its Ray workers import vLLM)."""
    config: dict[str, Any] = {"executor": RAY_EXECUTOR, "head": head, "package": package,
                              "version": version, "device": device, "env": dict(env)}
    return RankPlan(instance_id=instance.id, generation=uuid.uuid4().hex,
                    init_method=f"ray://{head}", world_size=instance.tp * instance.pp,
                    workers=rank_layout(instance), config=config)


class RayCluster:
    """The main worker's side: the head, the plan it serves, and the followers' exits."""

    def __init__(self, bus: Bus, plan: RankPlan, head: RayNode) -> None:
        self.bus = bus
        self.plan = plan
        self.head = head
        self._failure: str | None = None
        self._subs: list[Subscription] = []

    async def serve_plan(self) -> None:
        subjects = self.bus.subjects
        self._subs = [
            await self.bus.nc.subscribe(subjects.ranks(self.plan.instance_id), cb=self._on_plan),
            await self.bus.subscribe(subjects.rank_exits(self.plan.instance_id), RankExit,
                                     self._on_exit)]
        await self.bus.nc.flush()

    def failure(self) -> str | None:
        """What ended the cluster (a follower, the head), in words; None while it runs."""
        return self._failure or self.head.exited()

    async def _on_plan(self, msg: Msg) -> None:
        if msg.reply:
            await self.bus.nc.publish(msg.reply, encode(self.plan))

    async def _on_exit(self, event: RankExit, _msg: Msg) -> None:
        if event.generation == self.plan.generation and self._failure is None:
            self._failure = event.describe() + (f": {event.log_tail}" if event.log_tail else "")

    async def stop(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - the connection may be closing
                pass
        await asyncio.to_thread(self.head.stop)
