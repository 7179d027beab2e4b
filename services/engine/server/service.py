"""One engine instance as a process (`shoal engine --instance-id ID`), run by the worker agent.

Moves its instance DOWNLOADING (model files prepared, progress in the message) -> STARTING
(weights loaded) -> RUNNING (serving), or ERROR with the cause. SIGTERM drains: intake stops,
in-flight requests finish (up to drain_timeout), then the process exits. An instance placed with
tp / pp runs its ranks > 0 as child processes of this one (engine distributed/executor.py): only
rank 0 is on the bus; a rank that dies fails the step loop, which moves the instance to ERROR
naming the rank and exits, so the supervisor restarts the engine and every rank with it. When
the placement has subordinate workers, their agents start the ranks of their stages from the
plan this process publishes (ranks.py), and a rank of theirs that ends fails this engine too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from shoal.services.engine.frontend.async_engine import AsyncEngine
from shoal.services.engine.frontend.core_builder import gguf_blocks
from shoal.services.engine.config import EngineConfig
from shoal.services.engine.embedding.async_engine import AsyncEmbeddingEngine
from shoal.services.engine.embedding.pooling import is_embedding_model
from shoal.services.engine.model_prep import prepare_model
from shoal.services.engine.server.embed_service import serve_embeddings
from shoal.services.engine.server.handlers import EngineHandlers
from shoal.services.engine.server.lifecycle import (
    Gone, InstanceReporter, report_error, serve_instance
)
from shoal.services.engine.server.metrics import EngineMetrics, LoRACollector, cache_info
from shoal.services.engine.server.ranks import RankCoordinator
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.errors import ShoalError
from shoal.shared.logging import log_context
from shoal.shared.progress import progress_message
from shoal.shared.schemas.registry import InstancePublic, LoRAModule, ModelPublic
from shoal.shared.states import InstanceState, can_transition

log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 2.0


def engine_config(model: ModelPublic, instance: InstancePublic) -> EngineConfig:
    """The model's settings as an EngineConfig (engine_args were checked at deploy time; the
    config checks them again, as SamplingParams does a request's options)."""
    args = {"max_model_len": model.max_model_len, "dtype": model.dtype,
            "gpu_memory_utilization": model.gpu_memory_utilization,
            "device": "auto" if instance.gpu_indexes else "cpu",
            "tensor_parallel_size": instance.tp, "pipeline_parallel_size": instance.pp,
            **model.engine_args.given()}
    return EngineConfig(model=model.source, **{k: v for k, v in args.items() if v is not None})


async def run_engine(settings: Settings, stop: asyncio.Event, instance_id: str) -> None:
    bus = await Bus.connect(settings, name=f"shoal-engine-{instance_id}")
    registry = RegistryClient(bus)
    engine: AsyncEngine | AsyncEmbeddingEngine | None = None
    ranks: RankCoordinator | None = None
    try:
        with log_context(instance_id=instance_id):
            instance = await registry.get_instance(instance_id)
            model = await registry.get_model(id=instance.model_id)
            reporter = InstanceReporter(registry, instance)
            if instance.subordinate_workers:
                ranks = RankCoordinator(bus, settings, instance, engine_config(model, instance))
            try:
                engine = await start_engine(settings, reporter, model, ranks)
            except Gone as exc:
                log.info("not starting: %s", exc)
                return
            except Exception as exc:  # noqa: BLE001 - reported on the instance, then exit non-zero
                log.exception("engine failed to start")
                message = (exc.message if isinstance(exc, ShoalError)
                           else f"{type(exc).__name__}: {exc}")
                await report_error(reporter, f"engine failed to start: {message}")
                raise SystemExit(1) from None
            if isinstance(engine, AsyncEmbeddingEngine):
                await serve_embeddings(settings, bus, reporter, engine, model, stop)
            else:
                await serve(settings, bus, reporter, engine, model, stop, ranks)
    finally:
        if engine is not None:
            engine.shutdown()
        if ranks is not None:
            await ranks.stop()
        await bus.close()


async def start_engine(settings: Settings, reporter: InstanceReporter, model: ModelPublic,
                       ranks: RankCoordinator | None = None
                       ) -> AsyncEngine | AsyncEmbeddingEngine:
    """ranks: set for an instance whose stages span workers: rank 0 opens the rendezvous and
    waits for the subordinate workers' ranks, naming one that ends before it completes."""
    loop = asyncio.get_running_loop()
    first = InstanceState.DOWNLOADING if can_transition(reporter.instance.state,
                                                        InstanceState.DOWNLOADING) \
        else InstanceState.STARTING
    await reporter.move(first, "preparing model files")
    last_report = [0.0]

    def progress(stage: str, fraction: float) -> None:  # called on the preparing thread
        now = time.monotonic()
        if now - last_report[0] >= PROGRESS_EVERY_S or fraction >= 1.0:
            last_report[0] = now
            asyncio.run_coroutine_threadsafe(_message(reporter, progress_message(stage, fraction)),
                                             loop)

    config = engine_config(model, reporter.instance)
    model_dir = await asyncio.to_thread(prepare_model, model.source, settings.model_cache_dir,
                                        progress, None, gguf_blocks(config))
    if reporter.instance.state is not InstanceState.STARTING:
        await reporter.move(InstanceState.STARTING, "loading weights")
    if is_embedding_model(model_dir, config.task):  # an encoder or a decoder embedder: the
        # embedding engine (embedding/)
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            raise ShoalError("an embedding model runs as one rank: deploy it without tp / pp")
        return await asyncio.to_thread(AsyncEmbeddingEngine, config, model_dir)
    if ranks is None:
        return await asyncio.to_thread(AsyncEngine, config, model_dir=model_dir)
    await ranks.start()
    await reporter.move(InstanceState.STARTING, f"waiting for the ranks of "
                        f"{', '.join(w.worker_name for w in ranks.layout[1:])} at "
                        f"{ranks.init_method}")
    return await asyncio.to_thread(_multi_worker_engine, ranks, model_dir)


def _multi_worker_engine(ranks: RankCoordinator, model_dir: Path) -> AsyncEngine:
    from shoal.services.engine.distributed.executor import MultiprocExecutor
    from shoal.services.engine.frontend.core_builder import build_core

    executor = MultiprocExecutor(ranks.config, model_dir, local_ranks=ranks.local_ranks,
                                 peer_failures=ranks.failures)
    try:
        core = build_core(ranks.config, runner=executor, model_dir=model_dir)
    except BaseException:
        executor.close(graceful=False)
        raise
    return AsyncEngine(core=core)


async def serve(settings: Settings, bus: Bus, reporter: InstanceReporter, engine: AsyncEngine,
                model: ModelPublic, stop: asyncio.Event,
                ranks: RankCoordinator | None = None) -> None:
    registry = RegistryClient(bus)

    async def lora_modules() -> list[LoRAModule]:
        return (await registry.get_model(id=model.id)).lora_modules

    handlers = EngineHandlers(bus=bus, engine=engine, instance_id=reporter.instance.id,
                              model_name=model.name, lora_source=lora_modules)
    handlers.set_loras(model.lora_modules)
    core = engine.core
    handlers.metrics = metrics = EngineMetrics(model.name, reporter.instance.id,
                                               core.max_model_len, handlers.load,
                                               cache_info(core.config, core.runner.num_kv_blocks),
                                               lambda: engine.stats().spec_decode)
    core.on_step_tokens = metrics.iteration_tokens.observe  # prometheus is thread-safe
    if core.config.enable_lora:
        metrics.registry.register(LoRACollector(engine.stats, core.config.max_loras,
                                                metrics.labels))
    await serve_instance(settings, bus, reporter, handlers, metrics.registry, stop,
                         lambda: engine_failure(engine, ranks))


def engine_failure(engine: AsyncEngine, ranks: RankCoordinator | None = None) -> str | None:
    """The error that ended the engine's step loop, if it did, or a subordinate worker's rank
    that ended (or the worker that went silent) while the engine was idle."""
    if engine.error is not None:
        error = engine.error
        return error.message if isinstance(error, ShoalError) else repr(error)
    return ranks.failure_message() if ranks is not None else None


async def _message(reporter: InstanceReporter, message: str) -> None:
    try:
        await reporter.move(reporter.instance.state, message)
    except (ShoalError, Gone):
        pass
