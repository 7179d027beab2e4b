"""shared/loops.py, the one background-loop helper of every service: a failed pass is logged and
the loop goes on; a wake runs the next pass at once; a loop without a stop event runs until
cancelled. Long intervals throughout, so every pass here is one the test asked for."""

from __future__ import annotations

import asyncio
import logging

import pytest

from shoal.shared.loops import run_every

HOUR = 3600.0
log = logging.getLogger("test-loops")


async def test_a_failed_pass_is_logged_and_the_loop_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    stop, passes = asyncio.Event(), []

    async def action() -> None:
        passes.append(len(passes))
        if len(passes) == 1:
            raise OSError("disk gone")
        stop.set()

    wake = asyncio.Event()
    loop = asyncio.create_task(run_every(HOUR, stop, action, "test pass", log, wake=wake))
    while not passes:
        await asyncio.sleep(0)
    wake.set()
    await loop
    assert passes == [0, 1]
    assert "test pass failed" in caplog.text and "OSError: disk gone" in caplog.text


async def test_first_wait_and_no_stop_event_run_until_cancelled() -> None:
    passes: list[int] = []
    ran = asyncio.Event()

    async def action() -> None:
        passes.append(1)
        ran.set()

    wake = asyncio.Event()
    loop = asyncio.create_task(run_every(HOUR, None, action, "test pass", log, wake=wake,
                                         first_wait=True, debounce=0.001))
    for _ in range(20):
        await asyncio.sleep(0)
    assert passes == []  # first_wait: nothing before the first wait ends
    wake.set()
    await ran.wait()
    assert passes == [1]
    loop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await loop
