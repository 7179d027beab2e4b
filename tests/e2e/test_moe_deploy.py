"""A mixture-of-experts model deployed as a user does it: `shoal models deploy` of a (tiny,
random-weight) Qwen3-MoE folder with `--wait` against a real registry, scheduler, worker and
gateway; the worker's engine process serves it through the gateway (`openai` SDK) with the same
greedy tokens as the offline `LLM` and transformers; deleting the model stops the engine."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

from shoal.services.engine.frontend.llm import LLM
from shoal.services.engine.sampling_params import SamplingParams
from shoal.shared.embedded import free_port
from shoal.shared.schemas.registry import DeleteRequest
from tests.e2e.test_parallel_serving import until
from tests.e2e.test_serving import async_api, engine_pids, running_instance
from tests.integration.conftest import Stack, make_settings, running_services
from tests.tiny_models import save_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
PROMPT = [17, 402, 95, 230, 8, 311, 77, 164, 501]
"""Token ids (the tiny vocabulary is SmolLM2's first 512 tokens: its text would not fit)."""
MAX_TOKENS = 12


async def shoal_cli(stack: Stack, data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env.update(SHOAL_NATS_URL=str(stack.settings.nats_url), SHOAL_NAMESPACE=stack.settings.ns,
               SHOAL_DATA_DIR=str(data_dir))
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "shoal", *args],
                                   env=env, capture_output=True, text=True, timeout=300)


async def test_deploy_a_qwen3_moe_folder_and_serve_it(servers, tmp_path_factory) -> None:
    root = tmp_path_factory.mktemp("moe-e2e")
    folder = save_tiny_model("qwen3_moe", root / "tiny-qwen3-moe", seed=1)
    settings = make_settings(servers, root, gateway_port=free_port(None), scheduler_interval=1.0)
    async with running_services(settings, worker={"worker_name": "moe-worker"}, gateway={},
                                name="moe-e2e", clean=True) as stack:
        name = f"qwen3-moe-{uuid.uuid4().hex[:6]}"
        selector = [f"--worker-selector={k}={v}" for k, v in stack.selector.items()]
        done = await shoal_cli(stack, root / "cli", "models", "deploy", name, "--source",
                               str(folder), "--device", "cpu", "--max-model-len", "256",
                               "--engine-arg", "kv_cache_memory=8388608", *selector, "--wait")
        assert done.returncode == 0, (done.stdout, done.stderr)
        assert "RUNNING" in done.stdout, done.stdout
        model = await stack.client.get_model(name=name)
        inst = await running_instance(stack.client, model.id)

        api = async_api(f"http://127.0.0.1:{settings.gateway_port}")
        served = await api.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                              temperature=0, extra_body={"ignore_eos": True})
        assert served.usage.completion_tokens == MAX_TOKENS

        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        with LLM(str(folder), device="cpu", dtype="float32", num_kv_blocks=32) as llm:
            offline = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
        assert served.choices[0].text == offline.text
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        with torch.no_grad():
            ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=MAX_TOKENS,
                              min_new_tokens=MAX_TOKENS, do_sample=False,
                              pad_token_id=0)[0, len(PROMPT):].tolist()
        assert offline.token_ids == ref

        engines = engine_pids(inst.id)
        assert engines
        await stack.client.delete_model(DeleteRequest(id=model.id))

        async def gone() -> bool:
            return not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                           for p in engines)

        await until(gone, 60, "the engine to stop")
