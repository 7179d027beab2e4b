"""Waits on what a `shoal up` stack shows through its API, not on its log lines: a model the
gateway can route to, and a worker agent that registered again after a kill (and so adopted the
engines it found) and heartbeats since.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp

POLL_S = 0.2


async def _get(http: aiohttp.ClientSession, url: str) -> Any | None:
    """The JSON of a 200 answer, None while the gateway is not up or answers otherwise."""
    try:
        async with http.get(url) as resp:
            return await resp.json() if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None


async def wait_model_served(http: aiohttp.ClientSession, base: str, model: str, timeout_s: float,
                            alive: Callable[[], bool], context: Callable[[], str]) -> None:
    """Until the gateway lists `model` with a running instance it routes to (/v1/models'
    has_running_instance: its own routing table, not only the registry's state). `alive`: the
    stack still runs; `context`: what a failure shows (the stack's output, say)."""
    deadline = time.monotonic() + timeout_s
    while True:
        listed = await _get(http, f"{base}/v1/models")
        cards = [m for m in (listed or {}).get("data", []) if m["id"] == model]
        if cards and cards[0]["has_running_instance"]:
            return
        assert alive(), f"the stack exited: {context()}"
        assert time.monotonic() < deadline, \
            f"{model} not served after {timeout_s}s: {listed}\n{context()}"
        await asyncio.sleep(POLL_S)


async def only_worker(http: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    listed = await _get(http, f"{base}/api/v1/workers")
    assert listed is not None and len(listed["items"]) == 1, listed
    return dict(listed["items"][0])


async def wait_registered_again(http: aiohttp.ClientSession, base: str, before: dict[str, Any],
                                timeout_s: float) -> None:
    """Until the worker `before` (read before its agent was killed) registered again and has
    heartbeated since. A registration is a versioned write (heartbeats are not: registry
    repo/workers.py) and the agent adopts the engines it found right after it and before its
    first heartbeat (services/worker/agent.py), so a later heartbeat means they were adopted."""
    deadline = time.monotonic() + timeout_s
    registered_beat: str | None = None
    while True:
        now = await _get(http, f"{base}/api/v1/workers/{before['id']}")
        if now is not None and now["version"] > before["version"] and now["state"] == "READY":
            if registered_beat is None:
                registered_beat = now["last_heartbeat_at"]
            elif now["last_heartbeat_at"] != registered_beat:
                return
        assert time.monotonic() < deadline, \
            f"the worker did not register again and heartbeat: {before} -> {now}"
        await asyncio.sleep(POLL_S)
