"""Integration fixtures: Settings with short timeouts, and a registry running in-process."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from shoal.services.registry.service import run_registry
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings

ServiceMain = Callable[[Settings, asyncio.Event, asyncio.Event], Awaitable[None]]


def make_settings(servers, data_dir: Path, **overrides: object) -> Settings:
    values: dict[str, object] = dict(
        nats_url=servers.nats_url, database_url=servers.database_url, data_dir=data_dir,
        heartbeat_interval=0.5, heartbeat_timeout=2.0, heartbeat_check_interval=0.25,
        reschedule_after=2.0, request_timeout=5.0,
    )
    values.update(overrides)
    return Settings(**values)


@pytest.fixture(scope="session")
def settings(servers, data_dir: Path) -> Settings:
    return make_settings(servers, data_dir)


@contextlib.asynccontextmanager
async def running_service(main: ServiceMain,
                          settings: Settings) -> AsyncIterator[asyncio.Task[None]]:
    """Run `main(settings, stop, ready)` as a task until it is ready; stop it (and re-raise its
    error, if any) on exit."""
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(main(settings, stop, ready))
    waiter = asyncio.create_task(ready.wait())
    done, _ = await asyncio.wait({task, waiter}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        waiter.cancel()
        task.result()
    assert ready.is_set(), f"{getattr(main, '__name__', main)} did not become ready"
    try:
        yield task
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


def running_registry(settings: Settings
                     ) -> contextlib.AbstractAsyncContextManager[asyncio.Task[None]]:
    return running_service(run_registry, settings)


class RegistryHandle:
    """The session's registry; `restart()` stops it and starts a fresh one on the same database."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._cm: contextlib.AbstractAsyncContextManager[asyncio.Task[None]] | None = None

    async def start(self) -> None:
        self._cm = running_registry(self.settings)
        await self._cm.__aenter__()

    async def stop(self) -> None:
        assert self._cm is not None
        cm, self._cm = self._cm, None
        await cm.__aexit__(None, None, None)

    async def restart(self) -> None:
        await self.stop()
        await self.start()


@pytest.fixture(scope="session")
async def registry(settings: Settings) -> AsyncIterator[RegistryHandle]:
    handle = RegistryHandle(settings)
    await handle.start()
    yield handle
    if handle._cm is not None:
        await handle.stop()


@pytest.fixture(scope="session")
async def bus(settings: Settings, registry: None) -> AsyncIterator[Bus]:
    bus = await Bus.connect(settings, name="shoal-tests")
    yield bus
    await bus.close()


@pytest.fixture(scope="session")
def client(bus: Bus) -> RegistryClient:
    return RegistryClient(bus)
