"""Which model a request's `model` names: a model's own name or one of its aliases (vLLM's
`--served-model-name a b`: `b` is an alias of `a`). The gateway resolves an alias to the model's
name at the door, so routing, key limits (`model=a`), usage and metrics see one name, and the
answer carries it, as vLLM answers with its first served name whatever name was asked for.

A LoRA adapter's name (a model's lora_modules) resolves to its base model plus the adapter
(`resolve_lora`): routing goes to the base model's instances, the engine runs the adapter.

Aliases and adapters come from the registry's model list, kept for `ttl` seconds; a name it does not
know reloads it (at most every `miss_every` seconds, so made-up names cannot flood the
registry), and a model with a running instance is its own name without asking anyone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.errors import ShoalError


class ModelNames:
    def __init__(self, registry: RegistryClient, running: Callable[[], Iterable[str]],
                 ttl: float = 10.0, miss_every: float = 1.0) -> None:
        self._registry = registry
        self._running = running
        self._ttl = ttl
        self._miss_every = miss_every
        self._aliases: dict[str, str] = {}
        self._adapters: dict[str, str] = {}
        """LoRA adapter name -> its base model's name."""
        self._loaded_at = -float("inf")
        self._next_try = -float("inf")
        """No read before this (monotonic): a failed read is not retried by every request."""
        self._lock = asyncio.Lock()

    async def resolve(self, name: str) -> str:
        """The model's name for `name` (itself unless it is an alias)."""
        if name in self._running():
            return name
        if self._stale(name):
            async with self._lock:  # one reload for a burst of requests
                if self._stale(name):
                    await self._load()
        return self._aliases.get(name, name)

    def invalidate(self) -> None:
        """Read the model list at the next request (after this gateway changed adapters)."""
        self._loaded_at = self._next_try = -float("inf")

    async def resolve_lora(self, name: str) -> tuple[str, str | None]:
        """(the model's name, the LoRA adapter `name` is, or None)."""
        model = await self.resolve(name)
        if model == name and name in self._adapters:
            return self._adapters[name], name
        return model, None

    def _stale(self, name: str) -> bool:
        now = time.monotonic()
        age = now - self._loaded_at
        return now >= self._next_try and (
            age > self._ttl or (name not in self._aliases and name not in self._adapters
                                and age > self._miss_every))

    async def _load(self) -> None:
        self._next_try = time.monotonic() + self._miss_every
        try:
            models = await self._registry.list_models()
        except ShoalError:  # the registry is away: the names known so far stand
            return
        self._aliases = {alias: m.name for m in models for alias in m.aliases}
        self._adapters = {lora.name: m.name for m in models for lora in m.lora_modules}
        self._loaded_at = time.monotonic()
