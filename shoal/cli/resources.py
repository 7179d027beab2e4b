"""`shoal models|instances|workers|keys ...`: the registry over NATS, as tables or JSON."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, UTC
from typing import Any

from pydantic import BaseModel
from tabulate import tabulate

from shoal.shared.bus.client import Bus
from shoal.shared.bus.connection import redacted
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.errors import Unavailable
from shoal.shared.schemas.registry import (
    ApiKeyPublic, InstancePublic, ModelPublic, UsageRow, WorkerPublic,
)
from shoal.shared.units import GIB


def run(settings: Settings, action: Callable[[RegistryClient], Awaitable[Any]]) -> Any:
    async def go() -> Any:
        bus = await Bus.connect(settings, name="shoal-cli")
        try:
            return await action(RegistryClient(bus))
        except Unavailable as exc:
            raise Unavailable(namespace_hint(exc.message, settings)) from None
        finally:
            await bus.close()

    return asyncio.run(go())


def namespace_hint(message: str, settings: Settings) -> str:
    """NATS answers "no responders" at once when nothing serves the subject: reached with the
    wrong namespace (a stack started elsewhere: compose's is `compose`), name it."""
    if not message.startswith("no service answers"):
        return message
    return (f"{message}: nothing serves namespace {settings.ns!r} on "
            f"{redacted(settings.nats_url or '')} (set SHOAL_NAMESPACE to the stack's; docker "
            f"compose's is SHOAL_NAMESPACE=compose, README \"Docker compose\")")


def emit(items: BaseModel | Sequence[BaseModel], as_json: bool,
         table: Callable[[Sequence[Any]], str]) -> None:
    many = items if isinstance(items, (list, tuple)) else [items]
    if as_json:
        data = [i.model_dump(mode="json") for i in many]
        json.dump(data if isinstance(items, (list, tuple)) else data[0], sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(table(many))


def _age(when: datetime | None) -> str:
    if when is None:
        return "-"
    seconds = (datetime.now(UTC) - when).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def models_table(models: Sequence[ModelPublic]) -> str:
    rows = [[m.name, m.id, m.replicas, m.device.value, m.placement_strategy.value, m.source,
             m.version]
            for m in models]
    return tabulate(rows,
                    headers=["NAME", "ID", "REPLICAS", "DEVICE", "PLACEMENT", "SOURCE", "VERSION"])


def workers_table(workers: Sequence[WorkerPublic]) -> str:
    rows = []
    for w in workers:
        gpus = ", ".join(f"{g.index}:{g.name} {g.memory_total / GIB:.0f}G"
                         for g in w.status.gpus) or "-"
        rows.append([w.name + (" (simulated)" if w.simulated else ""), w.id, w.state.value,
                     w.status.cpu_cores, f"{w.status.memory_total / GIB:.1f}G", gpus,
                     ",".join(f"{k}={v}" for k, v in w.labels.items()) or "-",
                     _age(w.last_heartbeat_at)])
    return tabulate(rows,
                    headers=["NAME", "ID", "STATE", "CPUS", "RAM", "GPUS", "LABELS", "HEARTBEAT"])


def instances_table(instances: Sequence[InstancePublic]) -> str:
    """An instance across workers (pipeline stages) names each of them, the lead first, and
    their GPUs in the same order (`0,1; 0,1`)."""
    rows = []
    for i in instances:
        workers = [i.worker_name or "-"] + [s.worker_name for s in i.subordinate_workers]
        gpus = [",".join(map(str, g)) or "-"
                for g in [i.gpu_indexes] + [s.gpu_indexes for s in i.subordinate_workers]]
        rows.append([i.name, i.id, i.model_name, i.state.value, ", ".join(workers),
                     "; ".join(gpus) if any(g != "-" for g in gpus) else "-",
                     f"tp={i.tp} pp={i.pp}", (i.state_message or "")[:80]])
    return tabulate(rows,
                    headers=["NAME", "ID", "MODEL", "STATE", "WORKER", "GPUS", "PARALLEL",
                             "MESSAGE"])


def _limits(key: ApiKeyPublic) -> str:
    parts = []
    for limit in key.limits:
        values = [f"{name}={getattr(limit, name)}" for name in ("rpm", "tpm", "token_budget")
                  if getattr(limit, name) is not None]
        parts.append(f"{limit.model or '*'}: {' '.join(values)}")
    return "; ".join(parts) or "-"


def keys_table(keys: Sequence[ApiKeyPublic]) -> str:
    rows = [[k.name, k.id, k.prefix + "...", k.scope.value, _limits(k),
             k.created_at.strftime("%Y-%m-%d %H:%M"), "revoked" if k.revoked_at else "active"]
            for k in keys]
    return tabulate(rows, headers=["NAME", "ID", "PREFIX", "SCOPE", "LIMITS", "CREATED", "STATUS"])


def usage_table(rows: Sequence[UsageRow]) -> str:
    table = [[r.day.isoformat(), r.key_name, r.model, r.requests, r.prompt_tokens,
              r.cached_tokens, r.output_tokens, r.prompt_tokens + r.output_tokens] for r in rows]
    return tabulate(table, headers=["DAY", "KEY", "MODEL", "REQUESTS", "PROMPT", "CACHED",
                                    "OUTPUT", "TOTAL"])
