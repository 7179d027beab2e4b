"""The placement dry run over the bus: `POST /api/v1/models?dry_run=true` on the gateway asks a
scheduler replica (shoal.scheduler.placement.plan) where the model would go on the live fleet,
and nothing is written. Real registry, scheduler replica, simulated worker and gateway."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from tests.integration.conftest import running_service
from tests.integration.sched_helpers import llama_config, start_worker, stop_workers
from tests.integration.test_gateway import running_gateway

from shoal.services.scheduler.replica import run_scheduler
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
async def fleet(settings: Settings, registry) -> AsyncIterator[tuple[str, str]]:
    """A gateway and one simulated 1xA10-24GB worker with a label of its own; yields (url, tag).
    The scheduler replica is started by the tests that need one."""
    tag = uuid.uuid4().hex[:6]
    workers = [await start_worker(settings, f"dry-{tag}", "1xA10-24GB", {"dry": tag})]
    try:
        async with running_gateway(settings) as url:
            yield url, tag
    finally:
        await stop_workers(workers)


async def _dry_run(url: str, body: dict, query: str = "?dry_run=true") -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, \
            http.post(f"{url}/api/v1/models{query}", json=body) as resp:
        return resp.status, await resp.json()


async def test_without_a_scheduler_the_dry_run_is_503(fleet) -> None:
    url, tag = fleet
    status, body = await _dry_run(url, {"name": f"m-{tag}", "source": "/any/model.gguf"})
    assert status == 503, body
    assert ".scheduler.placement.plan" in body["error"]["message"]


async def test_dry_run_places_refuses_and_writes_nothing(fleet, settings: Settings,
                                                         client: RegistryClient,
                                                         tmp_path: Path) -> None:
    url, tag = fleet
    selector = {"dry": tag}
    async with running_service(run_scheduler, settings):
        small = llama_config(tmp_path / "small", 2048, 16, 8, 16)  # ~1B: one 24 GB GPU
        status, plan = await _dry_run(url, {"name": f"smol-{tag}", "source": small,
                                            "worker_selector": selector})
        assert status == 200, plan
        assert plan["fits"] is True and plan["worker_name"] == f"dry-{tag}"
        assert plan["placement"]["gpu_indexes"] == [0]
        assert plan["placement"]["claim"]["gpu_memory"]["0"] > 0
        assert plan["message"].startswith(f"Placement: dry-{tag} GPUs [0]")

        huge = llama_config(tmp_path / "huge", 8192, 64, 8, 80)  # ~70B: not on one 24 GB GPU
        status, plan = await _dry_run(url, {"name": f"huge-{tag}", "source": huge,
                                            "worker_selector": selector})
        assert status == 200 and plan["fits"] is False and plan["placement"] is None
        assert plan["message"].startswith("No placement. The model needs")

        status, err = await _dry_run(url, {"name": f"gone-{tag}", "source": "/no/such/model.gguf"})
        assert status == 400 and err["error"]["param"] == "source"
        assert "does not exist" in err["error"]["message"]
        status, err = await _dry_run(url, {"name": f"bad-{tag}", "source": huge, "replicas": -1})
        assert status == 400 and err["error"]["param"] == "replicas"
        status, err = await _dry_run(url, {"name": f"x-{tag}", "source": huge}, "?dry_run=maybe")
        assert status == 400 and err["error"]["param"] == "dry_run"
    names = {m.name for m in await client.list_models()}
    assert not {f"smol-{tag}", f"huge-{tag}", f"gone-{tag}", f"bad-{tag}"} & names
