"""An instance whose model names a backend other than our engine: `shoal engine --instance-id ID`
runs this adapter instead of the engine (run_instance), so the worker hosts, records, adopts and
restarts it as any engine.

The adapter prepares the model's files (DOWNLOADING, with progress), installs the backend's venv
on first use (progress in the instance's message), starts the backend process (STARTING: its
command line in the message) and waits until its health path answers and a one-token completion
succeeds, then serves the instance on the bus (proxy.py) as RUNNING, with the backend's /metrics
announced among the targets under the instance's labels. A backend that exits fails its streams
at once, moves the instance to ERROR with its log's tail and ends the adapter (exit 1): the
worker restarts both with back-off. SIGTERM drains: intake stops, in-flight requests finish,
then the backend is stopped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from prometheus_client import CollectorRegistry

from shoal.services.backends.args import (
    Command, Stage, VllmLaunch, build_custom, build_vllm, ray_node
)
from shoal.services.backends.embed import serves_embeddings
from shoal.services.backends.proxy import BackendHandlers
from shoal.services.backends.ray_cluster import (
    RayCluster, free_port_range, node_host, ray_plan, spawn_node, wait_gcs
)
from shoal.services.backends.venv import (
    DEFAULT_VLLM_VERSION, backend_cache, ensure_ray, vllm_package, vllm_python
)
from shoal.services.engine import (
    ENGINE_DEFAULTS, Gone, InstanceReporter, load_tokenizer, prepare_model, report_error,
    run_engine, serve_instance
)
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.errors import ShoalError
from shoal.shared.logging import log_context
from shoal.shared.loops import run_every, wait_or_stop
from shoal.shared.metrics_endpoint import advertised_host, answer_discovery
from shoal.shared.process import die_with_parent
from shoal.shared.progress import progress_message
from shoal.shared.schemas.backends import BackendKind
from shoal.shared.schemas.metrics import MetricsTarget
from shoal.shared.schemas.ranks import rank_layout
from shoal.shared.schemas.registry import InstancePublic, ModelPublic
from shoal.shared.states import InstanceState, can_transition

log = logging.getLogger(__name__)
REPORT_EVERY_S = 2.0
POLL_S = 1.0
SCRAPE_EVERY_S = 1.0
STOP_WAIT_S = 20.0


class BackendExited(ShoalError):
    """The backend process ended; the message has its exit status and its log's tail."""


async def run_instance(settings: Settings, stop: asyncio.Event, instance_id: str) -> None:
    """Our engine, or the adapter of the model's backend."""
    bus = await Bus.connect(settings, name=f"shoal-backend-{instance_id}")
    try:
        registry = RegistryClient(bus)
        try:
            instance = await registry.get_instance(instance_id)
            model = await registry.get_model(id=instance.model_id)
        except ShoalError:
            model = None  # the engine's own start says what is wrong
        if model is not None and model.backend is not BackendKind.SHOAL:
            await run_backend(settings, bus, stop, instance, model)
            return
    finally:
        await bus.close()
    await run_engine(settings, stop, instance_id)


@dataclass
class Backend:
    process: subprocess.Popen[bytes]
    log_path: Path
    base_url: str
    port: int
    host: str
    ray: RayCluster | None = None
    """The instance's Ray cluster (a placement across workers): its failure is the backend's."""

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def exited(self) -> str | None:
        code = self.process.poll()
        if code is not None:
            cause = first_error(self.tail(400))
            failure = f"the backend exited with {code}: " + (
                f"{cause} (log tail: {self.tail()})" if cause else self.tail())
        elif self.ray is None or (failure := self.ray.failure()) is None:  # type: ignore[assignment]
            return None
        self._signal_group(signal.SIGKILL)  # vLLM's engine core outlives a killed server
        return failure

    def stop(self) -> None:
        """SIGTERM to the backend's process group (its server and the workers it started),
        SIGKILL to what is left after STOP_WAIT_S."""
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)
        self.process.wait()
        if self.ray is not None:
            self.ray.head.stop()  # the followers go when the instance leaves STARTING/RUNNING

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)  # its own group: spawn() starts a session
        except (ProcessLookupError, PermissionError):
            pass


ERROR_LINE = re.compile(r"^(?:\(.*?\) ERROR .*?\] )?([A-Z][\w.]*(?:Error|Exception): .+)$")
"""An exception line of a traceback, bare or in a vLLM ERROR record ("(EngineCore pid=N) ERROR
<date> [file:line] ValueError: ...")."""


def first_error(log: str) -> str | None:
    """The first exception a log names (vLLM's engine core logs its root cause long before the
    server's last traceback, which only says "see root cause above")."""
    for line in log.splitlines():
        if found := ERROR_LINE.search(line):
            return found.group(1).strip()[:500]
    return None


async def run_backend(settings: Settings, bus: Bus, stop: asyncio.Event,
                      instance: InstancePublic, model: ModelPublic) -> None:
    registry = RegistryClient(bus)
    backend: Backend | None = None
    handlers: BackendHandlers | None = None
    with log_context(instance_id=instance.id):
        reporter = InstanceReporter(registry, instance)
        try:
            try:
                backend, handlers = await start_backend(settings, bus, reporter, model, stop)
            except Gone as exc:
                log.info("not starting: %s", exc)
                return
            except Exception as exc:  # noqa: BLE001 - reported on the instance, then exit 1
                log.exception("backend failed to start")
                message = exc.message if isinstance(exc, ShoalError) else (
                    f"{type(exc).__name__}: {exc}")
                await report_error(reporter, f"{model.backend.value} failed to start: {message}")
                raise SystemExit(1) from None
            if handlers is not None:
                await serve(settings, bus, reporter, handlers, backend, model, stop)
        finally:
            if handlers is not None:
                await handlers.close()
            if backend is not None:
                await asyncio.to_thread(backend.stop)
                if backend.ray is not None:
                    await backend.ray.stop()


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


async def start_backend(settings: Settings, bus: Bus, reporter: InstanceReporter,
                        model: ModelPublic, stop: asyncio.Event
                        ) -> tuple[Backend | None, BackendHandlers | None]:
    loop = asyncio.get_running_loop()
    last = [0.0]

    def progress(message: str) -> None:  # called on a worker thread
        now = time.monotonic()
        if now - last[0] >= REPORT_EVERY_S:
            last[0] = now
            asyncio.run_coroutine_threadsafe(_message(reporter, message), loop)

    first = (InstanceState.DOWNLOADING if can_transition(reporter.instance.state,
                                                         InstanceState.DOWNLOADING)
             else InstanceState.STARTING)
    await reporter.move(first, "preparing model files")
    model_dir = await asyncio.to_thread(
        prepare_model, model.source, settings.model_cache_dir,
        lambda stage, fraction: progress(progress_message(stage, fraction)))
    command = await asyncio.to_thread(build_command, settings, reporter.instance, model,
                                      Path(model_dir), progress)
    port = int(command.env.pop("SHOAL_BACKEND_PORT"))
    host = command.env.pop("SHOAL_BACKEND_HOST")
    ray = None
    if reporter.instance.subordinate_workers:  # vLLM across workers: its Ray cluster first
        ray = await start_ray(settings, bus, reporter, model, command)
    await reporter.move(InstanceState.STARTING, f"starting {model.backend.value}: "
                        + " ".join(command.argv[1:])[:1500])
    try:
        backend = spawn(settings, reporter.instance, command, host, port)
    except BaseException:
        if ray is not None:
            await ray.stop()
        raise
    backend.ray = ray
    embedding = await asyncio.to_thread(is_embedder, model, Path(model_dir))
    scores = embedding and await asyncio.to_thread(is_scorer, Path(model_dir))
    try:
        tokenizer = await asyncio.to_thread(load_tokenizer, model_dir)
        ready = await wait_ready(backend, model, tokenizer, stop, embedding, scores)
    except BaseException:
        await asyncio.to_thread(backend.stop)
        raise
    if not ready:
        await asyncio.to_thread(backend.stop)
        return None, None
    max_len = model.max_model_len or _context(model_dir)
    handlers = BackendHandlers(
        bus=bus, instance_id=reporter.instance.id, model_name=model.name,
        base_url=backend.base_url, served_name=model.name, tokenizer=tokenizer,
        max_model_len=max_len,
        max_num_seqs=model.engine_args.max_num_seqs or ENGINE_DEFAULTS.max_num_seqs,
        tool_call_parser=model.tool_call_parser(),
        reasoning_parser=model.reasoning_parser(),
        chat_template=model.engine_args.chat_template, embedding=embedding)
    return backend, handlers


async def start_ray(settings: Settings, bus: Bus, reporter: InstanceReporter, model: ModelPublic,
                    command: Command) -> RayCluster:
    """The instance's Ray head on this (main) worker, its GCS up, then the plan served to the
    subordinates' agents, who start their followers (worker/ray_follower.py)."""
    instance = reporter.instance
    head_cmd = Command(json.loads(command.env.pop("SHOAL_RAY_HEAD")), {})
    head_cmd.env.update(json.loads(command.env.pop("SHOAL_RAY_ENV")))
    host, gcs = command.env["RAY_ADDRESS"].rsplit(":", 1)
    await reporter.move(InstanceState.STARTING, f"starting the Ray head at {host}:{gcs}")
    logs = settings.data_dir / "logs"
    head = spawn_node(head_cmd, logs / f"ray-head-{instance.name}.log", "head",
                      settings.data_dir / "backends" / instance.name)
    try:
        await wait_gcs(head, host, int(gcs))
        device = "gpu" if instance.gpu_indexes else "cpu"
        plan = ray_plan(instance, f"{host}:{gcs}", vllm_package(device),
                        model.backend_version or DEFAULT_VLLM_VERSION, device, model.env)
        cluster = RayCluster(bus, plan, head)
        await cluster.serve_plan()
    except BaseException:
        await asyncio.to_thread(head.stop)
        raise
    workers = ", ".join(s.worker_name for s in instance.subordinate_workers)
    await reporter.move(InstanceState.STARTING,
                        f"Ray head up at {host}:{gcs}; followers joining from {workers}")
    return cluster


def is_embedder(model: ModelPublic, model_dir: Path) -> bool:
    """An embedding model: a BERT-family encoder (what our embedding engine serves), or vLLM's
    pooling flags in backend_parameters (a decoder served as an embedder)."""
    from shoal.services.engine import is_embedding_model

    return serves_embeddings(model.backend_parameters) or (
        model_dir.is_dir() and is_embedding_model(model_dir))


def is_scorer(model_dir: Path) -> bool:
    """A cross-encoder's folder (config.json names a sequence classifier): it answers
    /v1/score, and refuses the embedding a readiness probe would ask of an embedder."""
    from shoal.services.engine import is_cross_encoder

    config = model_dir / "config.json"
    return config.is_file() and is_cross_encoder(json.loads(config.read_text()))


def _context(model_dir: str | Path) -> int:
    from shoal.services.scheduler.claim import read_profile

    return read_profile(model_dir).shape.context_limit.max_model_len


def build_command(settings: Settings, instance: InstancePublic, model: ModelPublic,
                  model_dir: Path, progress: object) -> Command:
    """The backend's command for this worker (installing vLLM's venv first if need be); the
    chosen host and port ride in the env under SHOAL_BACKEND_* (taken out before the spawn)."""
    host = "127.0.0.1" if settings.metrics_host in ("127.0.0.1", "localhost") else (
        settings.metrics_host)
    if instance.subordinate_workers:  # vLLM and the Ray head on the address the others reach
        host = node_host(settings)
    port = free_port(host)
    where = {"SHOAL_BACKEND_PORT": str(port), "SHOAL_BACKEND_HOST": host}
    if model.backend is BackendKind.CUSTOM:
        data_dir = settings.data_dir / "backends" / instance.name
        data_dir.mkdir(parents=True, exist_ok=True)
        path = model.source if Path(model.source).exists() else str(model_dir)
        values = {"model_path": path, "port": str(port), "served_name": model.name,
                  "host": host, "model_name": model.name, "data_dir": str(data_dir)}
        cmd = build_custom(model.backend_command or "", model.backend_parameters, values,
                           model.env)
        return Command(cmd.argv, {**cmd.env, **where}, keep_cwd=True)  # as the user typed it
    device = "gpu" if instance.gpu_indexes else "cpu"
    python = vllm_python(settings, device, model.backend_version or DEFAULT_VLLM_VERSION,
                         progress)  # type: ignore[arg-type]
    distributed: dict[str, object] = {}
    if instance.subordinate_workers:  # Ray's ports and a rendezvous port on this worker
        distributed = dict(
            subordinates=tuple(Stage(s.worker_name, tuple(s.gpu_indexes))
                               for s in instance.subordinate_workers),
            ray_port=free_port_range(host), distributed_port=free_port(host))
    from shoal.services.scheduler.claim import compute_claim, read_profile

    profile = read_profile(model_dir)
    claim = compute_claim(profile, model, device)
    spec = model.engine_args.speculative_config
    launch = VllmLaunch(
        python=str(python), model_path=str(model_dir), served_names=(model.name, *model.aliases),
        port=port, main=Stage(host, tuple(instance.gpu_indexes),
                              sum(instance.claim.gpu_memory.values())),
        tp=instance.tp, pp=instance.pp, device=device,
        gpu_vendor="nvidia" if device == "gpu" else None,
        dtype=ENGINE_DEFAULTS.dtype(model.dtype or "auto", device),
        max_model_len=claim.max_model_len,
        gpu_memory_utilization=model.gpu_memory_utilization, kv_cache_bytes=claim.kv_cache,
        cpu_cores=tuple(sorted(settings.worker_cpus or os.sched_getaffinity(0))),
        backend_version=model.backend_version or DEFAULT_VLLM_VERSION,
        backend_parameters=tuple(model.backend_parameters),
        engine_args={k: v for k, v in model.engine_args.given().items()},
        speculative=spec,
        draft_model_path=(prepare_model(spec.model, settings.model_cache_dir)
                          if spec is not None and spec.model else None),
        extended_kv_cache=(model.extended_kv_cache.model_dump()
                           if model.extended_kv_cache else None),
        env=model.env, cache_dir=str(backend_cache(settings) / "vllm-cache"),
        **distributed)  # type: ignore[arg-type]
    cmd = build_vllm(launch)
    if launch.subordinates:  # the head's command rides along (taken out by start_ray)
        ray = ensure_ray(python, progress)  # type: ignore[arg-type]
        ranks = len(rank_layout(instance)[0].ranks)
        head = ray_node(launch, launch.main, str(ray),
                        num_cpus=ranks if device == "cpu" else None)
        where.update(SHOAL_RAY_HEAD=json.dumps(head.argv), SHOAL_RAY_ENV=json.dumps(head.env))
    for warning in cmd.warnings:
        log.warning("%s", warning)
    return Command(cmd.argv, {**cmd.env, **where}, cmd.injected, cmd.warnings)


def spawn(settings: Settings, instance: InstancePublic, command: Command, host: str,
          port: int) -> Backend:
    logs = settings.data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"backend-{instance.name}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}  # not its own
    env.update(command.env)
    # vLLM runs in a folder of its own: from a checkout of Shoal, `python -m` would import the
    # checkout's top-level folders (kernels/) in place of the packages vLLM asks for
    cwd = None
    if not command.keep_cwd:
        cwd = settings.data_dir / "backends" / instance.name
        cwd.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        process = subprocess.Popen(command.argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   cwd=cwd, preexec_fn=die_with_parent, start_new_session=True)
    log.info("started %s (pid %d, log %s)", command.argv[0], process.pid, log_path)
    return Backend(process, log_path, f"http://{host}:{port}", port, host)


async def wait_ready(backend: Backend, model: ModelPublic, tokenizer: object,
                     stop: asyncio.Event, embedding: bool = False, scores: bool = False
                     ) -> bool:
    """Until the health path answers 200 and a one-token completion (an embedder: one
    embedding; a cross-encoder: one score) succeeds (a server may answer its health before its
    model serves); False on `stop`, BackendExited if it ends."""
    path, probe = "/v1/completions", {
        "model": model.name, "prompt": [int(tokenizer.encode("Hi")[-1])],  # type: ignore
        "max_tokens": 1}
    if scores:
        path, probe = "/v1/score", {"model": model.name, "text_1": "Hi", "text_2": "Hi"}
    elif embedding:
        path, probe = "/v1/embeddings", {"model": model.name, "input": "Hi"}
    health = model.backend_health_path if model.backend is BackendKind.CUSTOM else "/health"
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while not stop.is_set():
            if (exited := backend.exited()) is not None:
                raise BackendExited(exited)
            try:
                async with session.get(backend.base_url + health) as r:
                    if r.status == 200:
                        async with session.post(backend.base_url + path, json=probe) as p:
                            if p.status == 200:
                                return True
            except (aiohttp.ClientError, TimeoutError):
                pass
            await wait_or_stop(stop, POLL_S)
    return False


async def serve(settings: Settings, bus: Bus, reporter: InstanceReporter,
                handlers: BackendHandlers, backend: Backend, model: ModelPublic,
                stop: asyncio.Event) -> None:
    """The engine's serving lifecycle (RUNNING, drain on stop, ERROR and exit 1 on failure),
    the backend's exit as the failure; its /metrics announced and its gauges read meanwhile."""
    address = f"{advertised_host(backend.host, settings.metrics_advertise_host)}:{backend.port}"
    target = MetricsTarget(service="backend", address=address, labels={
        "instance": reporter.instance.name, "model_name": model.name,
        "backend": model.backend.value})
    discovery = await answer_discovery(bus, target)
    scrape_stop = asyncio.Event()
    scrapes = asyncio.create_task(run_every(SCRAPE_EVERY_S, scrape_stop, handlers.scrape,
                                            "reading the backend's gauges", log, expected=()))

    def failure() -> str | None:
        exited = backend.exited()
        if exited is not None:
            handlers.fail_all()  # the streams end now, with an error
        return exited

    log.info("serving %s through %s at %s", model.name, model.backend.value, backend.base_url)
    try:
        await serve_instance(settings, bus, reporter, handlers, CollectorRegistry(), stop,
                             failure)
    finally:
        scrape_stop.set()
        await scrapes
        try:
            await discovery.unsubscribe()
        except Exception:  # noqa: BLE001 - the connection may be closing
            pass


async def _message(reporter: InstanceReporter, message: str) -> None:
    try:
        await reporter.move(reporter.instance.state, message)
    except (ShoalError, Gone):
        pass
