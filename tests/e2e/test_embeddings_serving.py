"""Embeddings end to end: all-MiniLM-L6-v2 deployed through the management API (HTTP), placed by
the scheduler on a real worker whose engine process serves it, and asked through the gateway
with the `openai` SDK (base64, its default, and float; texts and token ids; a list longer than
one bus batch), against sentence-transformers' own vectors; the refusals."""

from __future__ import annotations

import asyncio
import uuid

import aiohttp
import numpy as np
import openai
import pytest

from shoal.services.engine.model_prep import minilm_path
from shoal.services.gateway.embeddings import BATCH_INPUTS
from shoal.services.gateway.service import run_gateway
from shoal.services.scheduler.replica import run_scheduler
from shoal.services.worker.agent import run_worker
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.embedded import free_port
from shoal.shared.schemas.registry import DeleteRequest
from tests.e2e.test_serving import async_api, running_instance
from tests.integration.conftest import make_settings, running_registry

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SentenceTransformer = pytest.importorskip("sentence_transformers").SentenceTransformer
TEXTS = ["The capital of France is Paris.", "Paris is France's capital city.",
         "Bananas are yellow.", "word " * 100]


@pytest.fixture(scope="module")
async def stack(servers, tmp_path_factory):
    # heartbeat_timeout 10 s as in test_serving: the reference model loads in this process
    settings = make_settings(servers, tmp_path_factory.mktemp("embeddings-e2e"), drain_timeout=5.0,
                             heartbeat_timeout=10.0, engine_restart_max_backoff=2.0,
                             gateway_engine_dead_after=5.0,
                             gateway_port=free_port(None), scheduler_interval=1.0)
    tag = uuid.uuid4().hex[:6]
    async with running_registry(settings):
        bus = await Bus.connect(settings, name="embeddings-e2e")
        client = RegistryClient(bus)
        for leftover in await client.list_models():
            await client.delete_model(DeleteRequest(id=leftover.id))
        stop = asyncio.Event()
        tasks = []
        worker = {"worker_name": f"real-{tag}", "worker_labels": {"stack": tag}}
        for run, extra in ((run_scheduler, {}), (run_worker, worker), (run_gateway, {})):
            ready = asyncio.Event()
            tasks.append(asyncio.create_task(run(settings.model_copy(update=extra), stop, ready)))
            await asyncio.wait_for(ready.wait(), 30)
        url = f"http://127.0.0.1:{settings.gateway_port}"
        name = f"minilm-{tag}"
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/api/v1/models", json={
                    "name": name, "source": str(minilm_path()), "device": "cpu",
                    "worker_selector": {"stack": tag},
                    "engine_args": {"max_num_seqs": 32, "num_threads": 1}}) as r:
                assert r.status == 201, await r.text()
                model_id = (await r.json())["id"]
        await running_instance(client, model_id)
        try:
            yield url, name
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 90)
            await bus.close()


_REFERENCE: list[object] = []


async def reference(texts: list[str]) -> np.ndarray:
    """sentence-transformers' vectors, computed off the event loop the stack's services share."""
    def encode() -> np.ndarray:
        if not _REFERENCE:
            _REFERENCE.append(SentenceTransformer(str(minilm_path()), device="cpu"))
        return _REFERENCE[0].encode(texts)  # type: ignore[attr-defined]
    return await asyncio.to_thread(encode)


async def test_openai_sdk_embeddings_match_sentence_transformers(stack) -> None:
    url, name = stack
    api = async_api(url)
    ref = await reference(TEXTS)
    out = await api.embeddings.create(model=name, input=TEXTS)  # the SDK asks for base64
    got = np.array([d.embedding for d in out.data])
    assert got.shape == (4, 384) and np.abs(got - ref).max() <= 1e-5
    assert [d.index for d in out.data] == [0, 1, 2, 3] and out.model == name
    assert out.usage.prompt_tokens == out.usage.total_tokens > 100
    floats = await api.embeddings.create(model=name, input=TEXTS[0], encoding_format="float")
    assert np.abs(np.array(floats.data[0].embedding) - ref[0]).max() <= 1e-5
    # token ids go as given: the tokenizer's own ids, with [CLS] and [SEP], give the same vector
    ids = _REFERENCE[0].tokenizer(TEXTS[0])["input_ids"]  # type: ignore[attr-defined]
    by_ids = await api.embeddings.create(model=name, input=ids)
    assert np.abs(np.array(by_ids.data[0].embedding) - ref[0]).max() <= 1e-5
    assert by_ids.usage.prompt_tokens == len(ids)


async def test_more_inputs_than_one_batch_keep_their_order(stack) -> None:
    url, name = stack
    texts = [f"sentence number {i} about topic {i % 7}" for i in range(BATCH_INPUTS * 2 + 5)]
    out = await async_api(url).embeddings.create(model=name, input=texts)
    got = np.array([d.embedding for d in out.data])
    assert np.abs(got - await reference(texts)).max() <= 1e-5


async def test_refusals(stack) -> None:
    url, name = stack
    api = async_api(url)
    with pytest.raises(openai.BadRequestError) as err:  # not a Matryoshka model
        await api.embeddings.create(model=name, input="x", dimensions=64)
    assert err.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as err:
        await api.embeddings.create(model=name, input="word " * 400)
    assert err.value.body["code"] == "context_length_exceeded"
    out = await api.embeddings.create(model=name, input="word " * 400,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert out.usage.prompt_tokens == 256
    with pytest.raises(openai.BadRequestError) as err:  # an embedding model does not generate
        await api.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["code"] == "wrong_model_type"
    with pytest.raises(openai.NotFoundError):
        await api.embeddings.create(model="no-such-model", input="x")
