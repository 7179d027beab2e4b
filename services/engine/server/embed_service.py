"""Serving an embedding model's instance: the embedding engine's handlers, its /metrics (the
load gauges and prompt-token counter under vLLM's names), load messages, RUNNING, and the same
drain on SIGTERM as a generation engine (server/service.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from shoal.services.engine.embedding.async_engine import AsyncEmbeddingEngine
from shoal.services.engine.server.embed_handlers import EmbedHandlers
from shoal.shared.bus.client import Bus
from shoal.shared.config import Settings
from shoal.shared.metrics import EngineLoadCollector, new_registry
from shoal.shared.metrics_endpoint import MetricsEndpoint
from shoal.shared.schemas.registry import ModelPublic
from shoal.shared.states import InstanceState

if TYPE_CHECKING:
    from shoal.services.engine.server.service import InstanceReporter

log = logging.getLogger(__name__)


async def serve_embeddings(settings: Settings, bus: Bus, reporter: InstanceReporter,
                           engine: AsyncEmbeddingEngine, model: ModelPublic,
                           stop: asyncio.Event) -> None:
    from shoal.services.engine.server.service import Gone

    handlers = EmbedHandlers(bus, engine, reporter.instance.id, model.name)
    await handlers.start()
    registry = new_registry()
    registry.register(EngineLoadCollector(lambda: [handlers.load()]))
    endpoint = MetricsEndpoint(registry, "engine", settings, port=0, labels={
        "instance": reporter.instance.name, "model_name": model.name})
    await endpoint.start(bus)
    load_stop = asyncio.Event()
    loads = asyncio.create_task(handlers.publish_load_forever(load_stop))
    try:
        await reporter.move(InstanceState.RUNNING, None)
        log.info("serving embedding model %s as instance %s", model.name, reporter.instance.name)
        await stop.wait()
        await handlers.stop_intake()
        await handlers.wait_in_flight(settings.drain_timeout)
    except Gone as exc:
        log.info("stopping: %s", exc)
    finally:
        load_stop.set()
        await loads
        await endpoint.stop()
