"""Helpers of the scheduler's integration tests: config-only models, simulated workers, polling."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

from shoal.services.worker.agent import run_worker
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.schemas.registry import DeleteRequest, InstanceFilter, InstancePublic
from shoal.shared.states import InstanceState


def llama_config(folder: Path, hidden: int, heads: int, kv_heads: int, layers: int) -> str:
    """A config-only model folder: the scheduler sizes it from its shape (no weights needed)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": hidden, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "num_hidden_layers": layers,
        "intermediate_size": int(hidden * 3.5), "vocab_size": 32000,
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}))
    return str(folder)


async def start_worker(settings: Settings, name: str, devices: str, labels: dict[str, str]
                       ) -> tuple[asyncio.Task[None], asyncio.Event]:
    stop, ready = asyncio.Event(), asyncio.Event()
    ws = settings.model_copy(update={"worker_name": name, "simulate_devices": devices,
                                     "worker_labels": labels})
    task = asyncio.create_task(run_worker(ws, stop, ready))
    await asyncio.wait_for(ready.wait(), 10)
    return task, stop


async def stop_workers(workers: list[tuple[asyncio.Task[None], asyncio.Event]]) -> None:
    for task, stop in workers:
        stop.set()
        with contextlib.suppress(Exception):
            await task


async def delete_models(client: RegistryClient, tag: str) -> None:
    for m in await client.list_models():
        if m.name.endswith(tag):
            await client.delete_model(DeleteRequest(id=m.id))


async def wait_for(predicate, timeout: float, what: str, poll: float = 0.2):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = await predicate()
        if last:
            return last
        await asyncio.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}: {last!r}")


async def instances_of(client: RegistryClient, model_id: str) -> list[InstancePublic]:
    return await client.list_instances(InstanceFilter(model_id=model_id))


async def all_scheduled(client: RegistryClient, model_id: str, replicas: int
                        ) -> list[InstancePublic] | None:
    found = await instances_of(client, model_id)
    ok = len(found) == replicas and all(i.state is InstanceState.SCHEDULED for i in found)
    return found if ok else None
