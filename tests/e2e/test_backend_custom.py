"""A custom backend end to end: `shoal serve` itself as the OpenAI-compatible server command
(it installs with Shoal), deployed with --backend custom on a real worker, served through the
gateway by the instance's adapter (README "Backends"), with the same openai-SDK checks as the
vLLM backend (backend_checks.py); then all-MiniLM-L6-v2 behind it, /v1/embeddings forwarded to
the backend's."""

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
        with pytest.raises(openai.BadRequestError) as err:  # rerank is not forwarded (yet)
            await a.post("/rerank", cast_to=object, body={"model": name, "query": "q",
                                                          "documents": ["a"]})
        assert err.value.code == "wrong_model_type" and "backend" in err.value.message
    finally:
        current = await served.client.get_model(id=model.id)
        await served.client.delete_model(DeleteRequest(id=model.id, version=current.version))
