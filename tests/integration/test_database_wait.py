"""A registry started before its Postgres accepts connections (compose starts them together)
waits for it, up to SHOAL_DATABASE_WAIT, instead of exiting and being restarted in a loop; past
the wait it fails with the connection's error. The database here "starts" as a TCP forwarder to
the tests' real Postgres, opened on its port a while after the registry."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from shoal.services.registry.service import run_registry
from shoal.shared.embedded.net import free_port
from tests.integration.conftest import make_settings

pytestmark = pytest.mark.integration


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.close()


def _forwarder(host: str, port: int):  # noqa: ANN202
    async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, port)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    return forward


def _settings(servers, tmp_path: Path, port: int, wait: float):  # noqa: ANN001, ANN202
    url = make_url(servers.database_url).set(host="127.0.0.1", port=port)
    return make_settings(servers, tmp_path / "data", namespace=f"dw{uuid.uuid4().hex[:8]}",
                         database_url=url.render_as_string(hide_password=False),
                         database_wait=wait)


async def test_the_registry_waits_for_a_database_that_comes_late(servers, tmp_path: Path) -> None:
    real = make_url(servers.database_url)
    port = free_port()
    stop, ready = asyncio.Event(), asyncio.Event()
    registry = asyncio.create_task(run_registry(_settings(servers, tmp_path, port, 60.0), stop,
                                                ready))
    await asyncio.sleep(2.0)
    assert not registry.done() and not ready.is_set()  # still waiting, not exited
    server = await asyncio.start_server(_forwarder(real.host or "127.0.0.1", real.port or 5432),
                                        "127.0.0.1", port)
    try:
        await asyncio.wait_for(ready.wait(), 60)
    finally:
        stop.set()
        await asyncio.wait_for(registry, 30)
        server.close()


async def test_past_the_wait_the_registry_fails_with_the_error(servers, tmp_path: Path) -> None:
    stop = asyncio.Event()
    with pytest.raises(OSError):
        await asyncio.wait_for(run_registry(_settings(servers, tmp_path, free_port(), 1.0), stop),
                               30)
