"""A TCP proxy a test can cut and heal: a network partition between the processes that connect
through it and the server behind it, with no Docker. A test tool (it forwards bytes; it knows
nothing of NATS), not a mock of a service.

`cut()` is a silent partition, as a pulled cable or `docker network disconnect` looks from
either end: the connections stay open but no byte crosses (each side's pings go unanswered),
and new connections are accepted but never reach the server. `heal()` lets the held bytes
through again, so the peers may never see a disconnection at all: what a fence must survive.
"""

from __future__ import annotations

import asyncio
import contextlib


class PartitionProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        """Listen on a free local port; that port."""
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    def cut(self) -> None:
        self.flowing.clear()

    def heal(self) -> None:
        self.flowing.set()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for writer in list(self.writers):
            writer.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            await self.flowing.wait()  # a connection made during a cut never gets through
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except (OSError, asyncio.CancelledError):
            writer.close()
            self.writers.discard(writer)
            return
        self.writers.add(up_writer)
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(src, dst))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                await self.flowing.wait()  # held while cut: TCP's back-pressure does the rest
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(OSError, RuntimeError):
                dst.close()
            self.writers.discard(dst)
