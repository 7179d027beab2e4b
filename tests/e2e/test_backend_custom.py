"""A custom backend end to end: `shoal serve` itself as the OpenAI-compatible server command
(it installs with Shoal), deployed with --backend custom on a real worker, served through the
gateway by the instance's adapter (README "Backends"), with the same openai-SDK checks as the
vLLM backend (backend_checks.py); then all-MiniLM-L6-v2 behind it, /v1/embeddings forwarded to
the backend's, and a cross-encoder behind it, /v1/rerank and /v1/score forwarded to its
/v1/score."""

from __future__ import annotations

import sys
import uuid

import numpy as np
import openai
import pytest

from shoal.services.engine.model_prep import minilm_path
from shoal.shared.schemas.registry import DeleteRequest, ModelCreate
from tests.e2e import backend_checks as checks
from tests.e2e.test_serving import FRANCE, running_instance
from tests.tiny_models import save_tiny_cross_encoder

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
READY_TIMEOUT = 600
SERVE = (f"{sys.executable} -m shoal serve {{model_path}} --port {{port}} "
         "--served-model-name {served_name} --data-dir {data_dir}")
COMMAND = SERVE + " --max-model-len 1024"


@pytest.fixture(scope="module")
async def served(servers, tmp_path_factory):
    async with checks.serving(servers, tmp_path_factory.mktemp("backend-custom"), "custom",
                              READY_TIMEOUT, backend="custom",
                              backend_command=COMMAND,
                              backend_parameters=checks.TOOL_FLAGS) as served:
        yield served


class TestCustomBackend(checks.BackendChecks):
    metrics_series = "shoal:gateway_requests_in_flight"
    ready_timeout = READY_TIMEOUT


async def test_embeddings_are_forwarded_to_the_backend(served: checks.Served) -> None:
    """An embedding model behind a custom backend (a BERT encoder: the adapter knows it from
    config.json; vLLM's `--runner pooling` says so for a decoder): /v1/embeddings through the
    gateway, float and base64 alike, unit vectors that rank a paraphrase above another topic,
    usage counted; generation is refused as our embedding engine refuses it."""
    name = f"minilm-custom-{uuid.uuid4().hex[:6]}"
    model = await served.client.create_model(ModelCreate(
        name=name, source=str(minilm_path()), device="cpu", worker_selector=served.selector,
        backend="custom", backend_command=SERVE))
    try:
        await running_instance(served.client, model.id, READY_TIMEOUT)
        a = checks.api(served.url)
        texts = ["The capital of France is Paris.", "Paris is France's capital city.",
                 "Bananas are yellow."]
        floats = await a.embeddings.create(model=name, input=texts, encoding_format="float")
        packed = await a.embeddings.create(model=name, input=texts)  # the SDK's base64
        vectors = np.array([d.embedding for d in floats.data])
        assert vectors.shape == (3, 384) and floats.model == name
        assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
        assert np.allclose(vectors, [d.embedding for d in packed.data], atol=1e-6)
        similar = vectors @ vectors.T
        assert similar[0, 1] > similar[0, 2] + 0.2, similar
        assert floats.usage.prompt_tokens >= 20
        with pytest.raises(openai.BadRequestError) as err:
            await a.chat.completions.create(model=name, messages=FRANCE, max_tokens=4)
        assert err.value.code == "wrong_model_type"
        with pytest.raises(openai.BadRequestError) as err:  # forwarded: the backend refuses
            await a.post("/rerank", cast_to=object, body={"model": name, "query": "q",
                                                          "documents": ["a"]})
        assert err.value.code == "wrong_model_type"
    finally:
        current = await served.client.get_model(id=model.id)
        await served.client.delete_model(DeleteRequest(id=model.id, version=current.version))


async def test_rerank_and_score_are_forwarded_to_the_backend(served: checks.Served,
                                                            tmp_path) -> None:
    """A cross-encoder behind a custom backend (the adapter knows it from config.json):
    /v1/rerank and /v1/score through the gateway go to the backend's /v1/score, and answer as
    sentence-transformers' CrossEncoder scores the pairs; usage counted."""
    CrossEncoder = pytest.importorskip("sentence_transformers").CrossEncoder
    folder = save_tiny_cross_encoder(tmp_path / "cross-encoder")
    name = f"rerank-custom-{uuid.uuid4().hex[:6]}"
    model = await served.client.create_model(ModelCreate(
        name=name, source=str(folder), device="cpu", worker_selector=served.selector,
        backend="custom", backend_command=SERVE))
    try:
        await running_instance(served.client, model.id, READY_TIMEOUT)
        query = "What is the capital of France?"
        docs = ["Paris is the capital of France.", "Bananas are yellow.", "France"]
        ref = CrossEncoder(str(folder), device="cpu").predict([(query, d) for d in docs])
        a = checks.api(served.url)
        ranked = await a.post("/rerank", cast_to=object, body={"model": name, "query": query,
                                                                "documents": docs})
        assert [r["index"] for r in ranked["results"]] == sorted(range(3), key=lambda i: -ref[i])
        assert all(abs(r["relevance_score"] - ref[r["index"]]) <= 1e-5
                   for r in ranked["results"])
        assert ranked["usage"]["prompt_tokens"] > 10
        scored = await a.post("/score", cast_to=object, body={"model": name, "text_1": query,
                                                               "text_2": docs})
        assert np.abs(np.array([d["score"] for d in scored["data"]]) - ref).max() <= 1e-5
    finally:
        current = await served.client.get_model(id=model.id)
        await served.client.delete_model(DeleteRequest(id=model.id, version=current.version))
