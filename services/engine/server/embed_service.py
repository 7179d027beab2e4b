"""Serving an embedding model's instance: the embedding engine's handlers and its /metrics (the
load gauges and prompt-token counter under vLLM's names), served as every instance is
(lifecycle.py: load messages, RUNNING, the drain on SIGTERM)."""

from __future__ import annotations

import asyncio

from shoal.services.engine.embedding.async_engine import AsyncEmbeddingEngine
from shoal.services.engine.server.embed_handlers import EmbedHandlers
from shoal.services.engine.server.lifecycle import InstanceReporter, serve_instance
from shoal.shared.bus.client import Bus
from shoal.shared.config import Settings
from shoal.shared.metrics import EngineLoadCollector, new_registry
from shoal.shared.schemas.registry import ModelPublic


async def serve_embeddings(settings: Settings, bus: Bus, reporter: InstanceReporter,
                           engine: AsyncEmbeddingEngine, model: ModelPublic,
                           stop: asyncio.Event) -> None:
    handlers = EmbedHandlers(bus=bus, engine=engine, instance_id=reporter.instance.id,
                             model_name=model.name)
    registry = new_registry()
    registry.register(EngineLoadCollector(lambda: [handlers.load()]))
    # no step loop here whose failure ends the instance: it serves until the stop signal
    await serve_instance(settings, bus, reporter, handlers, registry, stop, lambda: None)
