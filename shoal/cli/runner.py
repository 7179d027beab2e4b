"""Running one asyncio service in the foreground: settings, logging, tracing, signals.

SIGINT/SIGTERM set a stop event (nats.py micro's example shape); the service drains and returns.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

from shoal.shared.config import Settings
from shoal.shared.embedded import read_stack_file
from shoal.shared.logging import setup_logging
from shoal.shared.telemetry import setup_tracing, shutdown_tracing

ServiceMain = Callable[[Settings, asyncio.Event], Awaitable[None]]


def resolve_settings(**overrides: object) -> Settings:
    """SHOAL_* variables first; URLs (and the namespace) missing there come from the stack file
    `shoal up` wrote."""
    settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    stack = read_stack_file(settings.stack_file)
    update = {key: stack[key] for key in ("nats_url", "database_url", "namespace")
              if getattr(settings, key) is None and stack.get(key)}
    return settings.model_copy(update=update) if update else settings


def run_service(name: str, main: ServiceMain, settings: Settings) -> int:
    setup_logging(settings.log_level, settings.log_json, service=name)
    setup_tracing(f"shoal-{name}", settings.otel_exporter)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(settings, stop)

    try:
        asyncio.run(serve())
    finally:
        shutdown_tracing()  # spans still batched for OTLP leave before the process does
    return 0
