"""`run_gateway`: serve the gateway's HTTP API on settings.gateway_host:gateway_port until `stop`.

A client that disconnects cancels its handler (aiohttp `handler_cancellation`), which aborts its
request in the engine. Shutdown: stop accepting, give open streams a moment, close the bus.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from shoal.services.gateway.app import make_app
from shoal.services.gateway.runner import GatewayRunner
from shoal.shared.config import Settings

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 5.0


async def run_gateway(settings: Settings, stop: asyncio.Event,
                      ready: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set; `ready` is set once the port listens and the bus is connected."""
    runner = GatewayRunner(make_app(settings), handler_cancellation=True, access_log=None,
                           shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.gateway_host, settings.gateway_port, reuse_address=True)
        await site.start()
        log.info("gateway listening on http://%s:%d", settings.gateway_host, settings.gateway_port)
        if ready is not None:
            ready.set()
        await stop.wait()
    finally:
        await runner.cleanup()
