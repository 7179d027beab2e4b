"""The pure parts of a vLLM instance's Ray cluster (services/backends/ray_cluster.py): the plan a
subordinate's agent reads, a Ray node's free port range, the host its node listens on, and the
root cause the adapter names when vLLM exits (service.first_error)."""

from __future__ import annotations

import socket
from datetime import UTC, datetime
from pathlib import Path

from shoal.services.backends.args import RAY_PORTS, RAY_WORKER_PORTS
from shoal.services.backends.ray_cluster import (
    RAY_EXECUTOR, free_port_range, node_host, ray_plan
)
from shoal.services.backends.service import first_error
from shoal.shared.config import Settings
from shoal.shared.schemas.ranks import RankPlan
from shoal.shared.schemas.registry import InstancePublic, ResourceClaim, SubordinateWorker
from shoal.shared.states import InstanceState

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def instance(pp: int = 3) -> InstancePublic:
    subs = [SubordinateWorker(worker_id=f"w{i}", worker_name=f"n{i}", gpu_indexes=[],
                              claim=ResourceClaim()) for i in (1, 2)]
    return InstancePublic(
        id="i1", name="m-i1", model_id="m", model_name="m", state=InstanceState.STARTING,
        worker_id="w0", worker_name="n0", tp=1, pp=pp, subordinate_workers=subs,
        created_at=NOW, updated_at=NOW, state_changed_at=NOW, version=1)


def test_the_plan_names_the_head_and_the_venv_each_follower_runs_from() -> None:
    plan = ray_plan(instance(), "10.0.0.1:41000", "vllm", "0.32.0", "gpu", {"HF_HOME": "/h"})
    again = RankPlan.model_validate_json(plan.model_dump_json())  # what crosses the bus
    assert again.config == {"executor": RAY_EXECUTOR, "head": "10.0.0.1:41000",
                            "package": "vllm", "version": "0.32.0", "device": "gpu",
                            "env": {"HF_HOME": "/h"}}
    assert again.init_method == "ray://10.0.0.1:41000" and again.world_size == 3
    assert [again.ranks_of(w) for w in ("w0", "w1", "w2")] == [[0], [1], [2]]
    assert ray_plan(instance(), "h:1", "vllm", "0.32.0", "gpu", {}).generation != \
        plan.generation  # each start of the head is a new plan: an old one is never joined


def test_a_nodes_port_range_is_free_and_the_host_follows_the_settings(tmp_path: Path) -> None:
    start = free_port_range("127.0.0.1")
    for port in (start, start + RAY_PORTS + RAY_WORKER_PORTS):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: binds
    local = Settings(data_dir=tmp_path, metrics_host="127.0.0.1")
    assert node_host(local) == "127.0.0.1"
    assert node_host(local.model_copy(update={"distributed_host": "10.1.1.1"})) == "10.1.1.1"
    assert node_host(local.model_copy(update={"metrics_host": "10.2.2.2"})) == "10.2.2.2"


def test_the_backends_root_cause_is_named_not_its_last_traceback() -> None:
    log = "\n".join([
        "(APIServer pid=1) WARNING ... ulimit: `OSError: [Errno 24] Too many open files`.",
        "(EngineCore pid=2) ERROR 11-27 21:26:46 [core.py:1510] Traceback (most recent call):",
        "(EngineCore pid=2) ERROR 11-27 21:26:46 [core.py:1510] ValueError: current platform "
        "cpu does not support ray.",
        "Traceback (most recent call last):",
        "RuntimeError: Engine core initialization failed. See root cause above."])
    assert first_error(log) == "ValueError: current platform cpu does not support ray."
    assert first_error("all fine\nexited") is None
