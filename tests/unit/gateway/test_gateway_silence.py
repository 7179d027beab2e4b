"""A silent engine: routed around after `gateway_engine_dead_after`, its streams failed only after
`gateway_engine_stall_timeout`. The soak (32 streams on an oversubscribed 2-core machine) saw a
CPU-starved engine go quiet for 3-12 s and then carry on; failing its streams at 3 s cut 64 of
them that would have finished."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from shoal.services.gateway.routing.instances import EngineGone, InstanceTable, LiveInstance
from shoal.services.gateway.routing.router import Router
from shoal.shared.config import Settings


def table_with_stream(dead_after: float = 3.0, stall: float = 30.0) -> tuple[
        InstanceTable, LiveInstance, asyncio.Queue[object]]:
    settings = Settings(gateway_engine_dead_after=dead_after, gateway_engine_stall_timeout=stall)
    table = InstanceTable(SimpleNamespace(on_disconnect=[]), None, settings,  # type: ignore[arg-type]
                          Router())
    inst = table.instances["i1"] = LiveInstance("i1", "m", 1, last_seen=100.0)
    queue: asyncio.Queue[object] = asyncio.Queue()
    assert table.watch("i1", queue) is inst
    return table, inst, queue


def test_a_short_silence_routes_around_the_engine_but_keeps_its_streams() -> None:
    table, inst, queue = table_with_stream()
    table.check_silence(now=102.0)
    assert not inst.is_dead and [c.instance_id for c in table.candidates("m")] == ["i1"]
    table.check_silence(now=104.0)
    assert inst.is_dead and table.candidates("m") == [] and queue.empty()
    table.heard(inst)  # a load or a stream reply: routable again
    assert not inst.is_dead and [c.instance_id for c in table.candidates("m")] == ["i1"]
    assert queue.empty()


def test_a_long_silence_fails_the_streams_once() -> None:
    table, inst, queue = table_with_stream(stall=10.0)
    table.check_silence(now=111.0)
    item = queue.get_nowait()
    assert isinstance(item, EngineGone) and "stopped responding" in item.reason
    table.check_silence(now=115.0)
    assert queue.empty()  # told once, not on every tick


def test_the_stall_timeout_is_never_shorter_than_dead_after() -> None:
    table, inst, queue = table_with_stream(dead_after=5.0, stall=1.0)
    table.check_silence(now=104.0)
    assert queue.empty() and not inst.is_dead
    table.check_silence(now=105.5)
    assert inst.is_dead and isinstance(queue.get_nowait(), EngineGone)
