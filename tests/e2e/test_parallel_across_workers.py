"""Pipeline stages on two worker agents: SmolLM2 deployed for CPU with pp=2 and placement
strategy `spread` gets one stage on each worker; the lead's engine is rank 0 and publishes the
rendezvous on NATS, the other agent starts rank 1, which joins over TCP (gloo). Answers through
the gateway with the `openai` SDK; SIGKILL of the subordinate worker's rank mid-stream ends the
stream with an error, the instance goes to ERROR naming the rank and the worker, then RUNNING
again with both ranks; deleting the model leaves no rank process on either worker."""

from __future__ import annotations

import uuid

import psutil
import pytest

from shoal.services.engine.model_prep import smollm2_gguf_path
from shoal.shared.embedded import free_port
from shoal.shared.schemas.registry import DeleteRequest, ModelCreate
from shoal.shared.states import InstanceState
from tests.e2e.test_parallel_serving import kill_mid_stream, until
from tests.e2e.test_serving import FRANCE, async_api, running_instance
from tests.integration.conftest import make_settings, running_services

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def processes_of(instance_id: str) -> dict[int, str]:
    """pid -> command line of every process serving the instance: the lead's engine (rank 0)
    and the subordinate worker's ranks carry its id."""
    found = {}
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if instance_id in cmd and "shoal" in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            found[p.pid] = cmd
    return found


def subordinate_rank(instance_id: str) -> int | None:
    ranks = [pid for pid, cmd in processes_of(instance_id).items() if "rank_process" in cmd]
    return ranks[0] if len(ranks) == 1 else None


async def test_pipeline_stages_on_two_workers_serve_fail_by_rank_and_come_back(
        servers, tmp_path_factory) -> None:
    root = tmp_path_factory.mktemp("pp-workers")
    settings = make_settings(servers, root / "stack", drain_timeout=5.0, heartbeat_timeout=15.0,
                             engine_restart_max_backoff=2.0, gateway_engine_dead_after=2.0,
                             gateway_port=free_port(None), scheduler_interval=1.0,
                             distributed_host="127.0.0.1")
    workers = [{"worker_name": name} for name in ("wa", "wb")]
    async with running_services(settings, worker=workers,
                                gateway={}, name="pp-workers", clean=True) as stack:
        client = stack.client
        model = await client.create_model(ModelCreate(
            name=f"smol-pp2w-{uuid.uuid4().hex[:6]}", source=str(smollm2_gguf_path()),
            device="cpu", pp=2, placement_strategy="spread", max_model_len=512,
            worker_selector=stack.selector,
            engine_args={"max_num_seqs": 4, "kv_cache_memory": 32 * 2**20}))
        inst = await running_instance(client, model.id)
        [sub] = inst.subordinate_workers
        assert (inst.tp, inst.pp) == (1, 2) and {inst.worker_name, sub.worker_name} == {
            "wa", "wb"}
        rank1 = subordinate_rank(inst.id)
        assert rank1 is not None, processes_of(inst.id)
        api = async_api(f"http://127.0.0.1:{settings.gateway_port}")
        answer = await api.chat.completions.create(model=model.name, messages=FRANCE,
                                                   temperature=0, max_tokens=20)
        assert "Paris" in answer.choices[0].message.content

        await kill_mid_stream(api, model.name, rank1)

        async def errored():  # type: ignore[no-untyped-def]
            i = await client.get_instance(inst.id)
            return i if i.state is InstanceState.ERROR else None

        failed = await until(errored, what="ERROR")
        assert f"rank 1 on worker {sub.worker_name} exited with code -9" in (
            failed.state_message or ""), failed.state_message
        back = await running_instance(client, model.id)
        again_rank1 = subordinate_rank(back.id)
        assert again_rank1 is not None and again_rank1 != rank1
        # RUNNING in the registry: the gateway routes to the new engine at once, no 503
        again = await api.chat.completions.create(model=model.name, messages=FRANCE,
                                                  temperature=0, max_tokens=20)
        assert "Paris" in again.choices[0].message.content

        assert len(processes_of(inst.id)) == 2  # rank 0's engine on one worker, rank 1
        await client.delete_model(DeleteRequest(id=model.id))

        async def all_gone():  # type: ignore[no-untyped-def]
            return not processes_of(inst.id)

        await until(all_gone, 60, "every rank on both workers to stop")
