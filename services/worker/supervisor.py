"""Runs one engine process per instance placed on this worker, and keeps it that way.

Reconciles on instance events and every few seconds: starts an engine for each instance placed
here (and, through StageRanks, the ranks of this worker's pipeline stages of instances another
worker leads), restarts a crashed one with exponential back-off (reporting ERROR with the tail
of its log), and stops (drains) engines whose instance was deleted, scaled down or moved away.

Engines outlive the agent's death (a crash, SIGKILL, OOM: they are not tied to it), as container
runtimes let GPUStack's instances outlive its worker: requests flow gateway -> engine without the
agent. Each engine is recorded in <data_dir>/engines/<instance_id>.json (engines.py), and the
next agent of this worker adopts the engines still running there instead of starting them again.
An agent that is stopped (SIGTERM, Ctrl-C) stops its engines, unless SHOAL_WORKER_KEEP_ENGINES
is set (an upgrade in place).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time

from nats.aio.msg import Msg

from shoal.services.worker.engines import EngineProcess
from shoal.services.worker.log_follow import LogFollower
from shoal.services.worker.stages import StageRanks
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.loops import run_every
from shoal.shared.process import stop_child
from shoal.shared.schemas.events import InstanceEvent
from shoal.shared.schemas.registry import InstanceFilter, InstancePublic, InstanceTransition
from shoal.shared.states import InstanceState, can_transition

log = logging.getLogger(__name__)
RECONCILE_EVERY_S = 3.0
COPY_LOGS_EVERY_S = 0.5
SERVED_STATES = frozenset({InstanceState.SCHEDULED, InstanceState.DOWNLOADING,
                           InstanceState.STARTING,
                           InstanceState.RUNNING, InstanceState.ERROR, InstanceState.UNREACHABLE})


class Supervisor:
    def __init__(self, settings: Settings, bus: Bus, worker_id: str) -> None:
        self.settings = settings
        self.bus = bus
        self.registry = RegistryClient(bus)
        self.worker_id = worker_id
        self.engines: dict[str, EngineProcess] = {}
        self.next_start: dict[str, float] = {}
        self.states: dict[str, InstanceState] = {}
        self._wake = asyncio.Event()
        self.records = settings.data_dir / "engines"
        self.worker_name = ""
        self.stages = StageRanks(settings, bus, worker_id)
        """The ranks this worker runs for instances led by another worker (pipeline stages)."""
        self.kept: list[str] = []
        """The instances whose engines `stop_all` left running for the next agent."""
        self.follower = LogFollower() if settings.worker_engine_log_stdout else None
        """Copies the engines' log files to our stdout (a container's log), when asked to."""

    def adopt(self, engines: dict[str, EngineProcess], worker_name: str) -> None:
        """Take over the engines a previous agent of this worker left (`running_engines`)."""
        self.worker_name = worker_name
        self.engines.update(engines)
        for instance_id, engine in engines.items():
            if self.follower is not None:
                self.follower.follow(engine.log_path, f"engine {instance_id}")
            log.info("adopted the running engine of instance %s (pid %d)", instance_id,
                     engine.process.pid)

    # ------------------------------------------------------------ engines that outlive us
    def _record(self, engine: EngineProcess) -> None:
        self.records.mkdir(parents=True, exist_ok=True)
        (self.records / f"{engine.instance_id}.json").write_text(json.dumps({
            "pid": engine.process.pid, "worker_name": self.worker_name,
            "log_path": str(engine.log_path), "generation": engine.generation}))

    def _forget(self, instance_id: str) -> None:
        (self.records / f"{instance_id}.json").unlink(missing_ok=True)

    def instance_states(self) -> dict[str, InstanceState]:
        """For the heartbeat: the instances whose engine runs here, in their last known state."""
        return {i: self.states[i] for i, e in self.engines.items() if e.alive and i in self.states}

    async def run(self, stop: asyncio.Event) -> None:
        """Reconcile on instance events and every few seconds until `stop`; a failed pass is
        logged and the next one comes (shared/loops.py): the engines run on whatever fails."""
        sub = await self.bus.nc.subscribe(self.bus.subjects.events_of("instances"),
                                          cb=self._on_event)
        copier = None
        if self.follower is not None:
            follower = self.follower

            async def copy_logs() -> None:
                follower.poll()

            copier = asyncio.create_task(run_every(COPY_LOGS_EVERY_S, stop, copy_logs,
                                                   "engine log copy", log))
        try:
            await run_every(RECONCILE_EVERY_S, stop, self.reconcile, "reconcile", log,
                            wake=self._wake)
        finally:
            if copier is not None:
                await copier
            await sub.unsubscribe()
            await asyncio.to_thread(self.stop_all)

    async def _on_event(self, msg: Msg) -> None:
        try:
            event = InstanceEvent.model_validate_json(msg.data)
        except ValueError:
            return
        if (event.data.worker_id == self.worker_id or event.id in self.engines
                or event.id in self.stages.groups
                or any(s.worker_id == self.worker_id for s in event.data.subordinate_workers)):
            self._wake.set()

    async def reconcile(self) -> None:
        listed = await self.registry.list_instances(InstanceFilter(
            worker_id=self.worker_id, include_subordinate=True))
        await self.stages.reconcile({i.id: i for i in listed if i.worker_id != self.worker_id})
        mine = {i.id: i for i in listed
                if i.worker_id == self.worker_id and i.state in SERVED_STATES}
        self.states = {i: inst.state for i, inst in mine.items()}
        for instance_id in [i for i in self.engines if i not in mine]:
            log.info("instance %s is no longer here: stopping its engine", instance_id)
            engine = self.engines.pop(instance_id)
            self._forget(instance_id)
            asyncio.get_running_loop().run_in_executor(None, self._stop, engine)
        now = time.monotonic()
        for instance_id, instance in mine.items():
            engine = self.engines.get(instance_id)
            if engine is not None and _stale(engine, instance):
                log.warning("instance %s was placed here anew (generation %s -> %d): stopping "
                            "the engine of its old placement", instance.name, engine.generation,
                            instance.placement_generation)
                del self.engines[instance_id]
                self._forget(instance_id)
                await asyncio.to_thread(self._stop, engine)
                engine = None
            if engine is not None and engine.alive:
                continue
            if engine is not None:  # it crashed
                del self.engines[instance_id]
                self._forget(instance_id)
                await self._report_crash(instance, engine)
                self.next_start[instance_id] = now + self._backoff(instance.restart_count + 1)
            if now >= self.next_start.get(instance_id, 0.0):
                await self._start(instance, now)

    async def _start(self, instance: InstancePublic, now: float) -> None:
        """Start the instance's engine; one that cannot be started (an OSError: its log, the
        executable, the CPU set) fails only its instance: ERROR with the reason, retried after
        the restart back-off, while the other engines go on."""
        try:
            engine = self._spawn(instance)
        except Exception as exc:  # noqa: BLE001 - reported on the instance, not fatal to the loop
            log.warning("cannot start the engine of %s: %s: %s", instance.name,
                        type(exc).__name__, exc)
            self.next_start[instance.id] = now + self._backoff(instance.restart_count + 1)
            await self._to_error(await self.registry.get_instance(instance.id),
                                 f"the worker cannot start the engine: {type(exc).__name__}: "
                                 f"{exc}", instance.placement_generation)
            return
        self.engines[instance.id] = engine
        self._record(engine)

    def _backoff(self, restarts: int) -> float:
        return min(self.settings.engine_restart_max_backoff, 2.0 ** min(restarts, 16))

    def _spawn(self, instance: InstancePublic) -> EngineProcess:
        logs = self.settings.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"engine-{instance.name}.log"
        env = dict(os.environ)
        env.update(SHOAL_NATS_URL=str(self.settings.nats_url), SHOAL_NAMESPACE=self.settings.ns,
                   SHOAL_DATA_DIR=str(self.settings.data_dir))  # a backend's logs and venvs
        for name in ("vllm_venv", "backend_cache_dir"):  # a backend's adapter reads them
            if getattr(self.settings, name) is not None:
                env[f"SHOAL_{name.upper()}"] = str(getattr(self.settings, name))
        if self.settings.distributed_host:  # rank 0's rendezvous address (multi-worker stages)
            env["SHOAL_DISTRIBUTED_HOST"] = self.settings.distributed_host
        if instance.gpu_indexes:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, instance.gpu_indexes))
        if self.follower is not None:  # from the end of what earlier engines wrote
            self.follower.follow(log_path, f"engine {instance.name}")
        with open(log_path, "ab") as out:  # not tied to this agent: it may outlive us
            process = subprocess.Popen(
                [sys.executable, "-m", "shoal", "engine", "--instance-id", instance.id],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        if self.settings.worker_cpus:  # before its ranks start: they inherit it
            os.sched_setaffinity(process.pid, self.settings.worker_cpus)
        log.info("started engine for %s (pid %d, log %s)", instance.name, process.pid, log_path)
        return EngineProcess(instance.id, process, log_path, time.monotonic(),
                             instance.placement_generation)

    async def _report_crash(self, instance: InstancePublic, engine: EngineProcess) -> None:
        code = engine.process.returncode
        log.warning("engine of %s exited with %s", instance.name, code)
        fresh = await self.registry.get_instance(instance.id)
        if fresh.state is InstanceState.ERROR:  # the engine reported its own error already
            message = fresh.state_message or f"engine exited with {code}"
        else:
            message = f"engine exited with {code}: {engine.log_tail()}"
        await self._to_error(fresh, message, instance.placement_generation)

    async def _to_error(self, fresh: InstancePublic, message: str, generation: int) -> None:
        """ERROR with `message`, one more failure counted (the scheduler's back-off reads it).
        The write names the placement the engine served (`generation`): refused (a Conflict,
        logged by the reconcile loop) if the instance was placed anew since."""
        if fresh.state is InstanceState.ERROR or can_transition(fresh.state, InstanceState.ERROR):
            await self.registry.transition_instance(InstanceTransition(
                id=fresh.id, version=fresh.version, state=InstanceState.ERROR,
                state_message=message[-2000:], restart_count=fresh.restart_count + 1,
                placement_generation=generation))

    def _stop(self, engine: EngineProcess) -> None:
        if engine.alive:
            stop_child(engine.process, signal.SIGTERM, self.settings.drain_timeout + 10)

    def stop_all(self) -> None:
        self.stages.stop_all()  # never adopted: rank 0 fails and the instance restarts
        if self.settings.worker_keep_engines:
            log.info("leaving %d engine(s) running for the next agent", len(self.engines))
            self.kept = sorted(i for i, e in self.engines.items() if e.alive)
            self.engines.clear()
            return
        for instance_id in self.engines:
            self._forget(instance_id)
        for engine in self.engines.values():
            if engine.alive:
                engine.process.send_signal(signal.SIGTERM)
        for engine in list(self.engines.values()):
            self._stop(engine)
        self.engines.clear()


def _stale(engine: EngineProcess, instance: InstancePublic) -> bool:
    """The engine was started for an earlier placement of the instance (placed here anew after
    a partition); an adopted engine of unknown generation is taken as current."""
    return engine.generation is not None and engine.generation != instance.placement_generation
