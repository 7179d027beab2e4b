"""The placement dry run over the bus: `POST /api/v1/models?dry_run=true` on the gateway asks a
scheduler replica (shoal.scheduler.placement.plan) where the model would go on the live fleet,
and nothing is written. Real registry, scheduler replica, simulated worker and gateway."""

from __future__ import annotations

import json
import struct
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from tests.integration.conftest import running_service
from tests.model_shapes import QWEN3_30B_A3B
from tests.integration.sched_helpers import llama_config, start_worker, stop_workers
from tests.integration.test_gateway import running_gateway

from shoal.services.engine import smollm2_gguf_path
from shoal.services.scheduler.replica import run_scheduler
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.schemas.registry import DeleteRequest

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


async def test_dry_run_of_an_moe_claims_every_expert(fleet, settings: Settings,
                                                     tmp_path: Path) -> None:
    """Qwen3-30B-A3B (config only): 3.3B parameters active per token would fit the 24 GB GPU,
    but the engine holds all 30.5B (61 GB in bf16): the plan says it does not fit, and why."""
    url, tag = fleet
    folder = tmp_path / "qwen3-30b-a3b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, "torch_dtype": "bfloat16"}))
    async with running_service(run_scheduler, settings):
        status, plan = await _dry_run(url, {"name": f"moe-{tag}", "source": str(folder),
                                            "worker_selector": {"dry": tag}})
    assert status == 200 and plan["fits"] is False, plan
    assert "30.5B parameters" in plan["message"], plan["message"]


def _never_runs(root: Path) -> list[tuple[dict, str, str]]:
    """(body, param, words) of deployments no fleet can run: sources that cannot be parsed, a
    tp SmolLM2's 9 heads cannot split, a context past its 8192 tokens."""
    def folder(name: str, config: bytes) -> str:
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_bytes(config)
        return str(root / name)

    crafted = root / "crafted.gguf"
    crafted.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**40, 1) + bytes(64))
    smol = str(smollm2_gguf_path())
    return [
        ({"source": folder("comma", b'{"hidden_size": 64,\n}')}, "source",
         "config.json is not valid JSON: Expecting property name enclosed in double quotes: "
         "line 2 column 1"),
        ({"source": folder("latin", b"\xff{}")}, "source", "config.json is not UTF-8 text"),
        ({"source": folder("array", b"[]")}, "source", "config.json is a JSON array"),
        ({"source": str(crafted)}, "source", "crafted.gguf is not a readable GGUF file"),
        ({"source": "/no/such/model.gguf"}, "source", "does not exist"),
        ({"source": smol, "device": "cpu", "tp": 2}, "tp",
         "tp=2 cannot work: tensor_parallel_size=2 cannot split LlamaForCausalLM: it does not "
         "divide its 9 attention heads"),
        ({"source": smol, "device": "cpu", "pp": 31}, "pp", "exceeds the 30 layers"),
        ({"source": smol, "device": "cpu", "max_model_len": 100000}, "max_model_len",
         "User-specified max_model_len (100000) is greater than the derived max_model_len "
         "(llama.context_length=8192"),
    ]


async def test_dry_run_and_deploy_refuse_what_can_never_run(fleet, settings: Settings,
                                                            client: RegistryClient,
                                                            tmp_path: Path) -> None:
    url, tag = fleet
    cases = _never_runs(tmp_path)
    async with running_service(run_scheduler, settings):
        for i, (body, param, words) in enumerate(cases):
            body = {"name": f"never{i}-{tag}", **body}
            for query in ("?dry_run=true", ""):
                status, err = await _dry_run(url, body, query)
                assert status == 400, (query, body, err)
                assert err["error"]["param"] == param, (query, err)
                assert words in err["error"]["message"], (query, err)
        # a model that fits nowhere now, nor on this fleet idle, is still deployed (PENDING)
        huge = llama_config(tmp_path / "huge", 8192, 64, 8, 80)
        status, plan = await _dry_run(url, {"name": f"huge-{tag}", "source": huge,
                                            "worker_selector": {"dry": tag}})
        assert status == 200 and plan["fits"] is False and plan["fits_when_idle"] is False
        small = llama_config(tmp_path / "small", 2048, 16, 8, 16)
        status, plan = await _dry_run(url, {"name": f"small-{tag}", "source": small,
                                            "worker_selector": {"dry": tag}})
        assert status == 200 and plan["fits"] is True and plan["fits_when_idle"] is True
        status, made = await _dry_run(url, {"name": f"huge-{tag}", "source": huge,
                                            "worker_selector": {"dry": tag}}, "")
        assert status == 201 and made["name"] == f"huge-{tag}"
        # an update that would make it unrunnable is refused the same way (nothing changes)
        for change, param in (({"max_model_len": 100000}, "max_model_len"), ({"tp": 3}, "tp")):
            async with aiohttp.ClientSession() as http, http.patch(
                    f"{url}/api/v1/models/{made['id']}",
                    json={**change, "version": made["version"]}) as resp:
                err = await resp.json()
                assert resp.status == 400 and err["error"]["param"] == param, err
        assert (await client.get_model(id=made["id"])).version == made["version"]
        async with aiohttp.ClientSession() as http, http.patch(
                f"{url}/api/v1/models/{made['id']}",
                json={"max_model_len": 2048, "version": made["version"]}) as resp:
            assert resp.status == 200 and (await resp.json())["max_model_len"] == 2048
        await client.delete_model(DeleteRequest(id=made["id"]))
    names = {m.name for m in await client.list_models()}
    assert not {f"never{i}-{tag}" for i in range(len(cases))} & names


async def test_without_a_scheduler_a_deploy_goes_on_unchecked(fleet,
                                                              client: RegistryClient) -> None:
    """No scheduler answers (they restart, or none runs yet): the deploy is not refused for it;
    the scheduler judges the model when it is back (its instances PENDING with the reason)."""
    url, tag = fleet
    status, made = await _dry_run(url, {"name": f"later-{tag}", "source": "/any/model.gguf",
                                        "replicas": 0}, "")
    assert status == 201, made
    await client.delete_model(DeleteRequest(id=made["id"]))


async def test_a_patch_changes_the_backend_fields_checked_as_a_create(
        fleet, client: RegistryClient) -> None:
    """backend_parameters, env, backend_version... change by PATCH, with a create's checks: a
    flag Shoal computes is a 400 naming backend_parameters, and the result must fit as a whole
    (at the gateway and at the registry alike); a refused PATCH changes nothing."""
    from shoal.shared.errors import InvalidRequest
    from shoal.shared.schemas.registry import ModelUpdate

    url, tag = fleet
    status, made = await _dry_run(url, {"name": f"vl-{tag}", "source": "/any/model",
                                        "replicas": 0, "backend": "vllm",
                                        "backend_parameters": ["--max-num-seqs 8"]}, "")
    assert status == 201, made

    version = made["version"]

    async def patch(change: dict) -> tuple[int, dict]:
        async with aiohttp.ClientSession() as http, http.patch(
                f"{url}/api/v1/models/{made['id']}",
                json={**change, "version": version}) as resp:
            return resp.status, await resp.json()

    refused = [({"backend_parameters": ["--port 9000"]}, "backend_parameters",
                "--port is computed by Shoal"),
               ({"env": {"A B": "1"}}, "env", "not an environment variable name"),
               ({"backend_version": "0.32.0; rm"}, "backend_version", "pattern"),
               ({"backend": "shoal"}, None, "backend_parameters and backend_version are for"),
               ({"backend": "custom"}, None, "backend custom needs backend_command")]
    for change, param, words in refused:
        status, err = await patch(change)
        assert status == 400 and err["error"]["param"] == param, (change, err)
        assert words in err["error"]["message"], (change, err)
    assert (await client.get_model(id=made["id"])).version == made["version"]
    with pytest.raises(InvalidRequest, match="backend_parameters and backend_version"):
        await client.update_model(ModelUpdate(id=made["id"], version=made["version"],
                                              backend="shoal"))  # the registry's own check
    status, changed = await patch({"backend_parameters": ["--max-num-seqs 4", "--enforce-eager"],
                                   "env": {"VLLM_LOGGING_LEVEL": "WARNING"},
                                   "backend_version": "0.31.0"})
    assert status == 200, changed
    assert changed["backend_parameters"] == ["--max-num-seqs 4", "--enforce-eager"]
    assert changed["env"] == {"VLLM_LOGGING_LEVEL": "WARNING"}
    assert changed["backend_version"] == "0.31.0" and changed["backend"] == "vllm"
    version = changed["version"]
    status, back = await patch({"backend": "shoal", "backend_parameters": [],
                                "backend_version": None})
    assert status == 200 and back["backend"] == "shoal", back
    await client.delete_model(DeleteRequest(id=made["id"]))
