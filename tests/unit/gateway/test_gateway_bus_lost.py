"""A lost NATS connection ends every stream in flight with an error at once: the engine's
replies published while the gateway was away may never arrive, and a stream waiting for them
would hang (the chaos test saw such a stream end only when the next kill failed its engine)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from shoal.services.gateway.routing.instances import EngineGone, InstanceTable, LiveInstance
from shoal.services.gateway.routing.router import Router
from shoal.shared.bus.connection import on_disconnected


async def test_the_bus_calls_its_disconnect_hooks_unless_closing() -> None:
    calls: list[str] = []
    bus = SimpleNamespace(closing=False, on_disconnect=[lambda: calls.append("a"),
                                                        lambda: 1 / 0,  # one bad hook
                                                        lambda: calls.append("b")])
    await on_disconnected([bus])()  # type: ignore[list-item]
    assert calls == ["a", "b"]
    bus.closing = True  # our own close: nothing in flight to save
    await on_disconnected([bus])()  # type: ignore[list-item]
    assert calls == ["a", "b"]


async def test_a_lost_bus_fails_every_stream_in_flight() -> None:
    bus = SimpleNamespace(on_disconnect=[])
    table = InstanceTable(bus, None, None, Router())  # type: ignore[arg-type]
    queues = []
    for name in ("i1", "i2"):
        table.instances[name] = LiveInstance(name, "m", 1, 0.0)
        queue: asyncio.Queue[object] = asyncio.Queue()
        assert table.watch(name, queue) is not None
        queues.append(queue)
    table.bus_lost()
    for queue in queues:
        item = queue.get_nowait()
        assert isinstance(item, EngineGone) and "NATS" in item.reason
    assert set(table.instances) == {"i1", "i2"}  # still routable once the bus is back
