"""LoRA adapters served through the whole stack: a tiny Llama deployed with two adapters in its
lora_modules (and enable_lora) on a real registry, scheduler, worker and gateway; the `openai`
SDK calls each adapter by name and the base model, and each answer is the offline engine's with
the same adapter (the greedy tokens PEFT gives: tests/parity/test_lora_parity.py);
/v1/models lists the adapters with their parent; vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter under traffic (a refused adapter is a 400 with the engine's reason and
is not kept; unloading an unknown one a 404 naming it); the engine's vllm:lora_requests_info."""

from __future__ import annotations

import asyncio
import json
import uuid

import aiohttp
import openai
import pytest

from shoal.services.engine import LLM, LoRARequest, SamplingParams
from shoal.shared.embedded import free_port
from shoal.shared.schemas.registry import ModelCreate
from tests.e2e.test_serving import async_api, running_instance, scrape_all
from tests.integration.conftest import make_settings, running_services
from tests.lora_adapters import ALL_TARGETS, save_adapter
from tests.tiny_models import save_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
PROMPT = [17, 402, 95, 230, 8, 311, 77, 164, 501]
MAX_TOKENS = 8


async def test_openai_sdk_calls_adapters_by_name(servers, tmp_path_factory) -> None:
    root = tmp_path_factory.mktemp("lora-e2e")
    base = save_tiny_model("llama", root / "tiny-llama", seed=1)
    adapters = {"sql-lora": save_adapter(base, root / "sql", targets=ALL_TARGETS, r=8, seed=1,
                                         scale=0.5),
                "chat-lora": save_adapter(base, root / "chat", targets=["q_proj", "v_proj"],
                                          r=4, seed=2)}
    # made before the stack starts: PEFT blocks the loop the in-process services share
    late = save_adapter(base, root / "late", targets=["v_proj", "down_proj"], r=4, seed=5)
    big = save_adapter(base, root / "big", targets=["q_proj"], r=32, seed=6)  # > rank 16
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    loras = [None, *(LoRARequest(n, i, str(p)) for i, (n, p) in enumerate(adapters.items(), 1))]
    with LLM(str(base), device="cpu", dtype="float32", num_kv_blocks=32, enable_lora=True,
             max_loras=2) as llm:  # the offline answers, also before the stack starts
        offline = llm.generate([PROMPT] * 3, params, use_tqdm=False, lora_request=loras)
    settings = make_settings(servers, root, gateway_port=free_port(None), scheduler_interval=1.0)
    async with running_services(settings, worker={"worker_name": "lora-worker"}, gateway={},
                                name="lora-e2e", clean=True) as stack:
        name = f"tiny-llama-{uuid.uuid4().hex[:6]}"
        model = await stack.client.create_model(ModelCreate(
            name=name, source=str(base), device="cpu", max_model_len=256,
            worker_selector=stack.selector,
            engine_args={"kv_cache_memory": 8 * 2**20, "enable_lora": True, "max_loras": 2},
            lora_modules=[{"name": n, "path": str(p)} for n, p in adapters.items()]))
        await running_instance(stack.client, model.id)
        api = async_api(f"http://127.0.0.1:{settings.gateway_port}")

        listed = {m.id: m for m in (await api.models.list()).data}
        for adapter, path in adapters.items():
            assert listed[adapter].parent == name and listed[adapter].root == str(path)
        assert listed[name].parent is None

        served = {}
        for asked in (name, *adapters):
            out = await api.completions.create(model=asked, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                               temperature=0, extra_body={"ignore_eos": True})
            assert out.model == asked and out.usage.completion_tokens == MAX_TOKENS
            served[asked] = out.choices[0].text

        assert [served[k] for k in (name, *adapters)] == [o.outputs[0].text for o in offline]
        assert len(set(served.values())) == 3  # the adapters change the answer

        with pytest.raises(openai.NotFoundError):  # not an adapter of any model: no such model
            await api.completions.create(model="nope-lora", prompt=PROMPT, max_tokens=2)
        info = [line for text in (await scrape_all(f"http://127.0.0.1:{settings.gateway_port}"))
                .values() for line in text.splitlines()
                if line.startswith("vllm:lora_requests_info{")]
        assert info and 'max_lora="2"' in info[0], info

        # runtime load and unload (vLLM's endpoints) while requests of the base model run
        url = f"http://127.0.0.1:{settings.gateway_port}/v1"
        traffic = [asyncio.create_task(api.completions.create(
            model=name, prompt=PROMPT, max_tokens=16, temperature=0,
            extra_body={"ignore_eos": True})) for _ in range(2)]
        async with aiohttp.ClientSession() as http:
            async def post(path: str, body: dict) -> tuple[int, str]:
                text = ""
                for _ in range(30):  # a 503: no engine to check the adapter now (a loaded
                    async with http.post(f"{url}/{path}", json=body) as r:  # machine's
                        text = await r.text()  # engine may miss a heartbeat): retry later
                        if r.status != 503:
                            return r.status, text
                    await asyncio.sleep(1)
                raise AssertionError(f"{path}: 503 for 30 s: {text}")

            status, text = await post("load_lora_adapter",
                                      {"lora_name": "late-lora", "lora_path": str(late)})
            assert (status, text) == (200, "Success: LoRA adapter 'late-lora' added successfully.")
            status, text = await post("load_lora_adapter",
                                      {"lora_name": "late-lora", "lora_path": str(late)})
            assert status == 400 and "has already been loaded" in text
            status, text = await post("load_lora_adapter",
                                      {"lora_name": "big-lora", "lora_path": str(big)})
            assert status == 400 and "greater than max_lora_rank 16" in json.loads(text)[
                "error"]["message"]
            out = await api.completions.create(model="late-lora", prompt=PROMPT,
                                               max_tokens=MAX_TOKENS, temperature=0,
                                               extra_body={"ignore_eos": True})
            assert out.model == "late-lora" and out.choices[0].text not in served.values()
            assert {m.id for m in (await api.models.list()).data} >= {"late-lora"}
            assert "big-lora" not in {m.id for m in (await api.models.list()).data}
            status, text = await post("unload_lora_adapter", {"lora_name": "late-lora"})
            assert (status, text) == (200,
                                      "Success: LoRA adapter 'late-lora' removed successfully.")
            status, text = await post("unload_lora_adapter", {"lora_name": "late-lora"})
            assert status == 404 and "'late-lora' cannot be found" in text
        for done in await asyncio.gather(*traffic, return_exceptions=True):  # (a 503 when the
            assert not isinstance(done, openai.APIStatusError) or done.status_code == 503  # engine
            assert isinstance(done, BaseException) or done.usage.completion_tokens == 16  # flaps)
        with pytest.raises(openai.NotFoundError):
            await api.completions.create(model="late-lora", prompt=PROMPT, max_tokens=2)
