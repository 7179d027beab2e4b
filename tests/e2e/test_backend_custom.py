"""A custom backend end to end: `shoal serve` itself as the OpenAI-compatible server command
(it installs with Shoal), deployed with --backend custom on a real worker, served through the
gateway by the instance's adapter (README "Backends"), with the same openai-SDK checks as the
vLLM backend (backend_checks.py)."""

from __future__ import annotations

import sys

import pytest

from tests.e2e import backend_checks as checks

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
READY_TIMEOUT = 600
COMMAND = (f"{sys.executable} -m shoal serve {{model_path}} --port {{port}} "
           "--served-model-name {served_name} --data-dir {data_dir} --max-model-len 1024")


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
