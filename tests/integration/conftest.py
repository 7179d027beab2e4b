"""Integration fixtures: Settings with short timeouts, a registry running in-process, and a whole
stack (registry, scheduler, worker, gateway) for the end-to-end modules (`running_services`)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shoal.services.gateway.service import run_gateway
from shoal.services.registry.service import run_registry
from shoal.services.scheduler.replica import run_scheduler
from shoal.services.worker.agent import run_worker
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.schemas.registry import DeleteRequest

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
    await _until_ready(task, ready, getattr(main, "__name__", str(main)))
    try:
        yield task
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def _until_ready(task: asyncio.Task[None], ready: asyncio.Event, what: str,
                       timeout: float = 30) -> None:
    """Wait for `ready`; a service that fails first raises its own error, not a timeout."""
    waiter = asyncio.create_task(ready.wait())
    done, _ = await asyncio.wait({task, waiter}, timeout=timeout,
                                 return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task in done:
        task.result()
    assert ready.is_set(), f"{what} did not become ready within {timeout:g} s"


def running_registry(settings: Settings
                     ) -> contextlib.AbstractAsyncContextManager[asyncio.Task[None]]:
    return running_service(run_registry, settings)


@dataclass(frozen=True)
class Stack:
    """What `running_services` started: its settings, a bus of the tests' own and a registry
    client on it, the gateway's base URL (None without a gateway), and the worker selector that
    places a model on this stack's worker only."""

    settings: Settings
    bus: Bus
    client: RegistryClient
    url: str | None
    selector: dict[str, str]


@contextlib.asynccontextmanager
async def running_services(settings: Settings, *, scheduler: bool = True,
                           worker: dict[str, Any] | list[dict[str, Any]] | None = None,
                           gateway: dict[str, Any] | None = None,
                           name: str = "shoal-tests", clean: bool = False
                           ) -> AsyncIterator[Stack]:
    """A registry, then the scheduler, a worker and a gateway in this process, each started once
    the one before is ready; `worker` / `gateway` are their settings overrides (None: not run; a
    list of overrides: one worker each). Workers are labelled `stack=<tag>` (unless given one)
    and `Stack.selector` selects them:
    modules share the database, and a worker of an earlier module is READY for a while after it
    stopped (until its heartbeats are missed), so a model placed by labels never lands there.
    `clean` first deletes the models earlier modules left. On exit every service is stopped at
    once (a worker drains its engines) and awaited."""
    workers = [] if worker is None else [worker] if isinstance(worker, dict) else worker
    tag = uuid.uuid4().hex[:6]
    workers = [{**w, "worker_labels": {"stack": tag, **w.get("worker_labels", {})}}
               for w in workers]
    selector = {"stack": workers[0]["worker_labels"]["stack"] if workers else tag}
    async with running_registry(settings):
        bus = await Bus.connect(settings, name=name)
        if clean:
            client = RegistryClient(bus)
            for leftover in await client.list_models():
                await client.delete_model(DeleteRequest(id=leftover.id))
        stop = asyncio.Event()
        tasks: list[asyncio.Task[None]] = []
        started = ([(run_scheduler, {})] if scheduler else []) + \
            [(run_worker, w) for w in workers] + \
            ([(run_gateway, gateway)] if gateway is not None else [])
        try:
            for main, extra in started:
                ready = asyncio.Event()
                tasks.append(asyncio.create_task(main(settings.model_copy(update=extra), stop,
                                                      ready)))
                await _until_ready(tasks[-1], ready, main.__name__)
            port = settings.model_copy(update=gateway or {}).gateway_port
            url = f"http://127.0.0.1:{port}" if gateway is not None else None
            yield Stack(settings, bus, RegistryClient(bus), url, selector)
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 90)
            await bus.close()


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
