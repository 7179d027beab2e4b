"""The gateway's alias resolution (model_names.py), without a network: an alias becomes its
model's name, a running model's name asks nobody, and made-up names cannot make the gateway
read the model list more than once a second."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from shoal.services.gateway.routing.model_names import ModelNames
from shoal.shared.errors import Unavailable


class Registry:
    def __init__(self) -> None:
        self.calls = 0
        self.models = [SimpleNamespace(name="smol", aliases=["gpt-4o", "smol-latest"],
                                       lora_modules=[SimpleNamespace(name="sql-lora")])]
        self.away = False

    async def list_models(self) -> list[SimpleNamespace]:
        self.calls += 1
        if self.away:
            raise Unavailable("registry away")
        return self.models


async def test_aliases_resolve_and_unknown_names_cost_one_read_a_second() -> None:
    registry = Registry()
    names = ModelNames(registry, lambda: ["running"], ttl=10.0, miss_every=1.0)  # type: ignore[arg-type]
    assert await names.resolve("running") == "running" and registry.calls == 0
    assert await names.resolve("gpt-4o") == "smol" and registry.calls == 1
    assert await names.resolve("smol-latest") == "smol" and registry.calls == 1
    found = await asyncio.gather(*(names.resolve(f"made-up-{i}") for i in range(200)))
    assert found == [f"made-up-{i}" for i in range(200)] and registry.calls == 1
    registry.models[0].aliases.append("new")
    later(names, 1.5)  # a second and a half later: a name it does not know reloads
    assert await names.resolve("new") == "smol" and registry.calls == 2
    registry.away = True
    later(names, 11)  # stale, and the registry is away: the names known still resolve, and
    for _ in range(50):  # the failed read is tried again a second later, not per request
        assert await names.resolve("gpt-4o") == "smol"
    assert registry.calls == 3


async def test_an_adapter_name_resolves_to_its_base_model_and_the_adapter() -> None:
    registry = Registry()
    names = ModelNames(registry, lambda: ["running"], ttl=10.0, miss_every=1.0)  # type: ignore[arg-type]
    assert await names.resolve_lora("sql-lora") == ("smol", "sql-lora")
    assert await names.resolve_lora("gpt-4o") == ("smol", None)
    assert await names.resolve_lora("smol") == ("smol", None)
    assert await names.resolve_lora("other") == ("other", None)
    for _ in range(20):  # a known adapter is no miss: no reread
        await names.resolve_lora("sql-lora")
    assert registry.calls == 1


def later(names: ModelNames, seconds: float) -> None:
    """As if `seconds` had passed since the last read."""
    names._loaded_at -= seconds
    names._next_try -= seconds
