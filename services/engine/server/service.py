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

from shoal.services.engine.async_engine import AsyncEngine
from shoal.services.engine.config import EngineConfig
from shoal.services.engine.embedding.async_engine import AsyncEmbeddingEngine
from shoal.services.engine.embedding.pooling import is_embedding_model
from shoal.services.engine.model_prep import prepare_model
from shoal.services.engine.server.embed_service import serve_embeddings
from shoal.services.engine.server.handlers import EngineHandlers
from shoal.services.engine.server.metrics import EngineMetrics, cache_info
from shoal.services.engine.server.ranks import RankCoordinator
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.errors import Conflict, NotFound, ShoalError
from shoal.shared.logging import log_context
from shoal.shared.metrics_endpoint import MetricsEndpoint
from shoal.shared.progress import progress_message
from shoal.shared.schemas.registry import InstancePublic, InstanceTransition, ModelPublic
from shoal.shared.states import InstanceState, can_transition

log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 2.0
FAILURE_POLL_S = 0.5


class Gone(Exception):
    """The instance was deleted or moved away: this engine has nothing to serve."""


class InstanceReporter:
    """Moves the instance through its states, re-reading on a stale version."""

    def __init__(self, registry: RegistryClient, instance: InstancePublic) -> None:
        self.registry = registry
        self.instance = instance
        self.worker_id = instance.worker_id

    async def move(self, state: InstanceState, message: str | None = None) -> None:
        for _ in range(5):
            current = self.instance.state
            if current is not state and not can_transition(current, state):
                raise Gone(f"instance is {current.value}; cannot move to {state.value}")
            try:
                self.instance = await self.registry.transition_instance(InstanceTransition(
                    id=self.instance.id, version=self.instance.version, state=state,
                    state_message=message))
                return
            except Conflict:
                await self.refresh()
        raise Gone(f"could not move the instance to {state.value}: it keeps changing")

    async def refresh(self) -> None:
        try:
            self.instance = await self.registry.get_instance(self.instance.id)
        except NotFound:
            raise Gone("the instance was deleted") from None
        instance = self.instance
        if instance.worker_id != self.worker_id or instance.state is InstanceState.PENDING:
            raise Gone("the instance was moved to another worker")


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
                await _report_error(reporter, f"engine failed to start: {message}")
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

    model_dir = await asyncio.to_thread(prepare_model, model.source, settings.model_cache_dir,
                                        progress)
    if reporter.instance.state is not InstanceState.STARTING:
        await reporter.move(InstanceState.STARTING, "loading weights")
    config = engine_config(model, reporter.instance)
    if is_embedding_model(model_dir):  # BERT-family encoder: the embedding engine (embedding/)
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
    from shoal.services.engine.engine_core import EngineCore

    executor = MultiprocExecutor(ranks.config, model_dir, local_ranks=ranks.local_ranks,
                                 peer_failures=ranks.failures)
    try:
        core = EngineCore(ranks.config, runner=executor, model_dir=model_dir)
    except BaseException:
        executor.close(graceful=False)
        raise
    return AsyncEngine(core=core)


async def serve(settings: Settings, bus: Bus, reporter: InstanceReporter, engine: AsyncEngine,
                model: ModelPublic, stop: asyncio.Event,
                ranks: RankCoordinator | None = None) -> None:
    handlers = EngineHandlers(bus, engine, reporter.instance.id, model.name)
    core = engine.core
    handlers.metrics = metrics = EngineMetrics(model.name, reporter.instance.id,
                                               core.max_model_len, handlers.load,
                                               cache_info(core.config, core.runner.num_kv_blocks),
                                               lambda: engine.stats().spec_decode)
    core.on_step_tokens = metrics.iteration_tokens.observe  # prometheus is thread-safe
    await handlers.start()
    endpoint = MetricsEndpoint(metrics.registry, "engine", settings, port=0, labels={
        "instance": reporter.instance.name, "model_name": model.name})
    await endpoint.start(bus)
    load_stop = asyncio.Event()
    loads = asyncio.create_task(handlers.publish_load_forever(load_stop))
    try:
        await reporter.move(InstanceState.RUNNING, None)
        log.info("serving %s as instance %s", model.name, reporter.instance.name)
        failed = await _until_stop_or_failure(engine, stop, ranks)
        if failed is not None:  # e.g. a tensor / pipeline parallel rank died: restart them all
            await _report_error(reporter, f"engine failed: {failed}")
            raise SystemExit(1)
        log.info("draining (up to %.0fs)", settings.drain_timeout)
        await handlers.stop_intake()
        await handlers.wait_in_flight(settings.drain_timeout)
    except Gone as exc:
        log.info("stopping: %s", exc)
    finally:
        load_stop.set()
        await loads
        await endpoint.stop()


async def _until_stop_or_failure(engine: AsyncEngine, stop: asyncio.Event,
                                 ranks: RankCoordinator | None = None) -> str | None:
    """Wait for the stop signal; return the engine's error if its step loop fails first (the
    streams have had theirs already: the instance then goes to ERROR and the supervisor
    restarts the engine, every rank with it), or a subordinate worker's rank ended (or the
    worker went silent) while the engine was idle."""
    while not stop.is_set():
        if engine.error is not None:
            error = engine.error
            return error.message if isinstance(error, ShoalError) else repr(error)
        if ranks is not None and (message := ranks.failure_message()) is not None:
            return message
        try:
            await asyncio.wait_for(stop.wait(), FAILURE_POLL_S)
        except TimeoutError:
            pass
    return None


async def _message(reporter: InstanceReporter, message: str) -> None:
    try:
        await reporter.move(reporter.instance.state, message)
    except (ShoalError, Gone):
        pass


async def _report_error(reporter: InstanceReporter, message: str) -> None:
    try:
        await reporter.refresh()
        await reporter.move(InstanceState.ERROR, message[:2000])
    except (ShoalError, Gone):
        log.warning("could not report the error on the instance")
