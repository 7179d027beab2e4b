"""`shoal models deploy` as a user types it, against a real registry, scheduler and worker: what can
never run is refused at once with the reason (a source that cannot be parsed, a tp the heads
cannot split, a max_model_len past the model's, a hub id with no hub), nothing is written, and
`--wait` exits non-zero with the reason when the instance goes to ERROR instead of waiting."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import huggingface_hub.constants
import pytest
from tests.integration.conftest import Stack, running_services
from tests.integration.sched_helpers import llama_config

from shoal.services.engine import smollm2_gguf_path
from shoal.shared.config import Settings

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
async def stack(settings: Settings) -> AsyncIterator[Stack]:
    """A registry, a scheduler and a real (CPU) worker, in this process."""
    async with running_services(settings, worker={}, name="deploy-cli", clean=True) as stack:
        yield stack


async def shoal(stack: Stack, tmp_path: Path, *args: str,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The real CLI in a process of its own, pointed at the stack."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env.update(SHOAL_NATS_URL=str(stack.settings.nats_url), SHOAL_NAMESPACE=stack.settings.ns,
               SHOAL_DATA_DIR=str(tmp_path / "cli"))
    return await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "shoal", *args], env=env, capture_output=True,
        text=True, timeout=timeout)


async def test_deploys_that_can_never_run_are_refused_at_once(stack: Stack, tmp_path: Path,
                                                              monkeypatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no hub here
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    comma = tmp_path / "comma"
    comma.mkdir()
    (comma / "config.json").write_text('{"hidden_size": 64,\n}')
    smol = str(smollm2_gguf_path())
    selector = [f"--worker-selector={k}={v}" for k, v in stack.selector.items()]
    cases = [
        (["--source", str(comma)], "config.json is not valid JSON: Expecting property name"),
        (["--source", smol, "--device", "cpu", "--tp", "2"],
         "tp=2 cannot work: tensor_parallel_size=2 cannot split LlamaForCausalLM: it does not "
         "divide its 9 attention heads"),
        (["--source", smol, "--device", "cpu", "--max-model-len", "100000"],
         "User-specified max_model_len (100000) is greater than the derived max_model_len"),
        (["--source", "org/not-cached"], "is not in the Hugging Face cache"),
    ]
    tag = uuid.uuid4().hex[:6]
    for i, (args, reason) in enumerate(cases):
        name = f"never{i}-{tag}"
        for mode in ("--wait", "--dry-run"):
            done = await shoal(stack, tmp_path, "models", "deploy", name, *args,
                               *selector, mode, timeout=60)
            assert done.returncode == 1, (mode, args, done.stdout, done.stderr)
            assert reason in done.stderr, (mode, args, done.stderr)
    names = {m.name for m in await stack.client.list_models()}
    assert not {f"never{i}-{tag}" for i in range(len(cases))} & names

    # the dry run is the scheduler's: where one instance would go on this stack
    done = await shoal(stack, tmp_path, "models", "deploy", f"smol-{tag}", "--source", smol,
                       "--device", "cpu", *selector, "--dry-run")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Placement: "), done.stdout


async def test_wait_exits_with_the_reason_when_the_instance_fails(stack: Stack,
                                                                  tmp_path: Path) -> None:
    """A model the scheduler places but whose engine cannot start (a config without weights):
    `--wait` shows the ERROR and its reason and exits 1 (the model stays deployed)."""
    name = f"noweights-{uuid.uuid4().hex[:6]}"
    source = llama_config(tmp_path / "noweights", 64, 4, 2, 2)
    selector = [f"--worker-selector={k}={v}" for k, v in stack.selector.items()]
    done = await shoal(stack, tmp_path, "models", "deploy", name, "--source", source,
                       "--device", "cpu", *selector, "--wait", timeout=180)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "ERROR" in done.stdout + done.stderr, done.stdout
    assert "engine failed to start" in done.stderr, done.stderr
    model = await stack.client.get_model(name=name)
    assert model.source == source
