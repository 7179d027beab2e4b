"""`shoal up`: the whole local stack in the foreground, and Ctrl-C stops all of it.

Embedded NATS and PostgreSQL when SHOAL_NATS_URL / SHOAL_DATABASE_URL are not set, then one
process per service (each its own session, so the terminal's Ctrl-C reaches only this process,
which stops them in order: front to back, then the servers). Crashed services and embedded
servers are restarted (servers on the same port and files), and everything started here dies
with this process even when it is SIGKILLed (PR_SET_PDEATHSIG). One `shoal up` per data dir (a
lock held while it runs); a start first ends what a killed run left behind.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, UTC

from shoal.shared.process import die_with_parent
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.embedded import read_stack_file
from shoal.shared.embedded import (
    Credentials, EmbeddedNats, EmbeddedPostgres, end_orphans, write_stack_file,
)
from shoal.shared.errors import NotFound, ShoalError
from shoal.cli.progress import failed_start, wait_running
from shoal.shared.bus.deploy import preflight
from shoal.shared.schemas.registry import InstancePublic, ModelCreate
from shoal.shared.states import InstanceState, WorkerState

STOP_TIMEOUT_S = 40.0
READY_TIMEOUT_S = 120.0
MODEL_TIMEOUT_S = 900.0
SCHEDULER_WAIT_S = 30.0
"""How long a deploy waits for this stack's scheduler to answer its dry run."""


class StartFailed(Exception):
    """The stack cannot start (another one runs on the data dir, a service died at start)."""


@dataclass
class Child:
    name: str
    argv: list[str]
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    exited_at: float | None = None

    def start(self, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(self.argv, env=env, start_new_session=True,
                                        preexec_fn=die_with_parent)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"shoal: {self.name} did not stop in {STOP_TIMEOUT_S:.0f}s; killing it",
                  flush=True)
            self.process.kill()
            self.process.wait()


@dataclass
class Server:
    """An embedded server under supervision: restarted with back-off when it dies."""

    name: str
    server: EmbeddedNats | EmbeddedPostgres
    restarts: int = 0
    next_try: float = 0.0

    def supervise(self, now: float) -> None:
        if self.server.alive or now < self.next_try:
            return
        code = self.server.process.returncode
        print(f"shoal: embedded {self.name} exited with {code}; restarting it "
              f"(same port, same files)", flush=True)
        started = time.monotonic()
        try:
            self.server.restart()
        except (OSError, RuntimeError, TimeoutError) as exc:
            self.restarts += 1
            delay = min(30.0, 2.0 ** min(self.restarts, 5))
            self.next_try = time.monotonic() + delay
            print(f"shoal: embedded {self.name} did not restart ({exc}); trying again in "
                  f"{delay:.0f}s", flush=True)
            return
        self.restarts = 0
        print(f"shoal: embedded {self.name} is back at {self.server.public_url} after "
              f"{time.monotonic() - started:.1f}s", flush=True)


@dataclass
class Stack:
    settings: Settings
    services: list[str]
    extra_args: dict[str, list[str]] = field(default_factory=dict)
    nats: EmbeddedNats | None = None
    postgres: EmbeddedPostgres | None = None
    children: list[Child] = field(default_factory=list)
    servers: list[Server] = field(default_factory=list)
    lock_fd: int | None = None

    def claim_data_dir(self) -> None:
        """Hold <data_dir>/up.lock while running (the kernel drops it when this process dies,
        however it dies); then end the servers a killed run left on these files."""
        data = self.settings.data_dir
        data.mkdir(parents=True, exist_ok=True)
        fd = os.open(data / "up.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            owner = read_stack_file(self.settings.stack_file).get("pid", "?")
            raise StartFailed(f"another `shoal up` (pid {owner}) runs on {data}: stop it first, "
                              "or give this one another SHOAL_DATA_DIR") from None
        self.lock_fd = fd
        stale = read_stack_file(self.settings.stack_file)
        if stale:
            print(f"shoal: the previous run on {data} (pid {stale.get('pid', '?')}) did not stop "
                  "cleanly; cleaning up after it", flush=True)
        from shoal.services.worker.supervisor import end_engines_left

        for what in end_orphans(data) + end_engines_left(data):
            print(f"shoal: stopped {what}, left running by a previous run", flush=True)
        self.settings.stack_file.unlink(missing_ok=True)

    def start_servers(self) -> tuple[str, str]:
        self.claim_data_dir()
        data = self.settings.data_dir
        nats_url = self.settings.nats_url
        database_url = self.settings.database_url
        credentials = None if nats_url and database_url else Credentials.load_or_create(data)
        if not nats_url:
            self.nats = EmbeddedNats.start(data / "nats", port=4222, credentials=credentials)
            self.servers.append(Server("NATS", self.nats))
            nats_url = self.nats.url
            print(f"shoal: embedded NATS at {self.nats.public_url}", flush=True)
        if not database_url:
            self.postgres = EmbeddedPostgres.start(data / "postgres", credentials=credentials)
            self.servers.append(Server("PostgreSQL", self.postgres))
            database_url = self.postgres.url
            print(f"shoal: embedded PostgreSQL at {self.postgres.public_url}", flush=True)
        if credentials is not None:
            print(f"shoal: credentials in {data / 'credentials.json'} (0600)", flush=True)
        gateway_url = f"http://{self.settings.gateway_host}:{self.settings.gateway_port}"
        write_stack_file(self.settings.stack_file, nats_url, database_url,
                         gateway_url=gateway_url, namespace=self.settings.ns, pid=os.getpid())
        print(f"shoal: namespace {self.settings.ns} (NATS subjects shoal.{self.settings.ns}.*)",
              flush=True)
        self.settings = self.settings.model_copy(update={"nats_url": nats_url,
                                                         "database_url": database_url})
        return nats_url, database_url

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(SHOAL_NATS_URL=str(self.settings.nats_url),
                   SHOAL_DATABASE_URL=str(self.settings.database_url),
                   SHOAL_DATA_DIR=str(self.settings.data_dir),
                   SHOAL_NAMESPACE=self.settings.ns,
                   SHOAL_GATEWAY_HOST=self.settings.gateway_host,
                   SHOAL_GATEWAY_PORT=str(self.settings.gateway_port))
        if self.settings.api_key:
            env["SHOAL_API_KEY"] = self.settings.api_key
        return env

    def start_services(self) -> None:
        env = self.env()
        for name in self.services:
            child = Child(name,
                          [sys.executable, "-m", "shoal", name, *self.extra_args.get(name, [])])
            child.start(env)
            self.children.append(child)

    def failed_child(self) -> Child | None:
        """A service that has exited (while the stack starts, that is fatal)."""
        return next((c for c in self.children
                     if c.process is not None and c.process.poll() is not None), None)

    def supervise_once(self) -> None:
        """Restart a dead embedded server, then a crashed service, with back-off (1 s doubling
        to 30 s)."""
        now = time.monotonic()
        for server in self.servers:
            server.supervise(now)
        now = time.monotonic()
        for child in self.children:
            if child.process is None or child.process.poll() is None:
                continue
            if child.exited_at is None:
                child.exited_at = now
                print(f"shoal: {child.name} exited with {child.process.returncode}", flush=True)
            if now - child.exited_at >= min(30.0, 2.0 ** min(child.restarts, 5)):
                print(f"shoal: restarting {child.name}", flush=True)
                child.restarts += 1
                child.exited_at = None
                child.start(self.env())

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop()
        if self.nats is not None:
            self.nats.stop()
        if self.postgres is not None:
            self.postgres.stop()
        if self.lock_fd is not None:  # only the owner of the data dir removes its stack file
            self.settings.stack_file.unlink(missing_ok=True)
            os.close(self.lock_fd)
            self.lock_fd = None


DEFAULT_MODEL = "SmolLM2-135M-Instruct"


async def deploy_and_wait(settings: Settings, spec: ModelCreate, deadline: float,
                          stopping: Callable[[], bool], since: datetime,
                          strict: bool = False) -> InstancePublic | None:
    """Deploy `spec` (unless a model of that name exists) and wait for a RUNNING instance,
    showing its progress; an instance in ERROR is returned too (the caller says why). What the
    scheduler refuses raises InvalidRequest before anything is deployed, and with `strict` (the
    one-machine stack of `shoal serve`) so does a model no worker here can ever hold
    (StartFailed). None when stopped or timed out (the stack keeps running)."""
    bus = await Bus.connect(settings, name="shoal-up")
    try:
        client = RegistryClient(bus)
        plan = await preflight(bus, spec, wait_s=SCHEDULER_WAIT_S)  # this stack's scheduler
        if strict and plan is not None and not plan.fits_when_idle:
            raise StartFailed(f"{spec.name} can never be placed on this stack: {plan.message}")
        try:
            model = await client.get_model(name=spec.name)
        except NotFound:
            model = await client.create_model(spec)
            print(f"shoal: deployed {spec.name} from {spec.source}", flush=True)
        instance = await wait_running(client, model.id, deadline, stopping, since)
        if instance is None and not stopping():
            print(f"shoal: {spec.name} has no RUNNING instance yet; see `shoal instances list`",
                  flush=True)
        return instance
    finally:
        await bus.close()


async def wait_ready(settings: Settings, deadline: float, since: datetime,
                     stack: Stack | None = None) -> str:
    """Until the registry answers, a worker is READY with a heartbeat from this run (a row left
    READY by a previous run does not count) and, with a gateway, it answers /health; returns
    the worker's name. A service that exits meanwhile fails the start (StartFailed)."""
    bus = await Bus.connect(settings, name="shoal-up")
    gateway = (f"http://{settings.gateway_host}:{settings.gateway_port}/health"
               if stack is not None and "gateway" in stack.services else None)
    try:
        client = RegistryClient(bus)
        worker = None
        while time.monotonic() < deadline:
            failed = stack.failed_child() if stack is not None else None
            if failed is not None:
                raise StartFailed(f"{failed.name} exited with {failed.process.returncode} "
                                  "while the stack was starting (its output is above)")
            try:
                ready = [w for w in await client.list_workers() if w.state is WorkerState.READY
                         and w.last_heartbeat_at is not None and w.last_heartbeat_at >= since]
                worker = ready[0].name if ready else None
            except ShoalError:
                pass
            if worker is not None and (gateway is None
                                       or await asyncio.to_thread(_answers, gateway)):
                return worker
            await asyncio.sleep(0.2)
        raise TimeoutError("the stack did not become ready in time")
    finally:
        await bus.close()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def up(settings: Settings, services: list[str], extra_args: dict[str, list[str]],
       model: ModelCreate | None = None, strict: bool = False) -> int:
    """Run the stack; with `model`, deploy it and wait until it serves. `strict` (`shoal
    serve`): a model that is refused, can never be placed here or fails to start ends the stack
    with the reason and exit status 1; otherwise (`shoal up`) the stack keeps running."""
    started = time.monotonic()
    since = datetime.now(UTC)
    stopping = False
    is_ready = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        if not is_ready:  # still starting: interrupt the wait
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    stack = Stack(settings, services, extra_args)
    code = 0
    try:
        stack.start_servers()
        stack.start_services()
        worker = asyncio.run(wait_ready(stack.settings, started + READY_TIMEOUT_S, since, stack))
        is_ready = True
        print(f"shoal: ready in {time.monotonic() - started:.1f}s — worker {worker} READY; "
              f"data in {settings.data_dir}", flush=True)
        if "gateway" in services:
            base = f"http://{settings.gateway_host}:{settings.gateway_port}"
            print(f"shoal: dashboard {base}/  (API docs {base}/docs)", flush=True)
        if model is not None:
            instance = asyncio.run(deploy_and_wait(stack.settings, model,
                                                   time.monotonic() + MODEL_TIMEOUT_S,
                                                   lambda: stopping, since, strict))
            if instance is not None and instance.state is InstanceState.ERROR:
                if strict:  # `shoal serve` exits, as `vllm serve` does when its engine fails
                    raise StartFailed(failed_start(model.name, instance))
                print(f"shoal: {failed_start(model.name, instance)}; the worker retries it "
                      "with back-off (`shoal instances list`)", file=sys.stderr, flush=True)
            elif instance is not None:
                print(f"shoal: {model.name} RUNNING as {instance.name} after "
                      f"{time.monotonic() - started:.1f}s", flush=True)
                if "gateway" in services:
                    print(serving_hint(settings, model.name), flush=True)
        print("shoal: press Ctrl-C to stop everything", flush=True)
        while not stopping:
            stack.supervise_once()
            time.sleep(0.3)
    except KeyboardInterrupt:
        pass
    except (StartFailed, TimeoutError) as exc:
        print(f"shoal: {exc}", flush=True)
        code = 1
    finally:
        print("shoal: stopping...", flush=True)
        stack.stop()
        print("shoal: stopped", flush=True)
    return code


def serving_hint(settings: Settings, model: str) -> str:
    base = f"http://{settings.gateway_host}:{settings.gateway_port}"
    lines = [f"shoal: OpenAI-compatible endpoint {base}/v1  (model {model!r})",
             f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\",
             f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", "
             f"\"content\": \"What is the capital of France?\"}}]}}'"]
    if settings.api_key:
        lines.append("  send the key given with --api-key: -H 'Authorization: Bearer <key>'")
    elif settings.require_api_key:
        lines.append("  API keys are required: create one with `shoal keys create NAME` and add "
                     "-H 'Authorization: Bearer <secret>'")
    else:
        lines.append("  (no API key needed; set SHOAL_REQUIRE_API_KEY=true and use "
                     "`shoal keys create NAME` to require one)")
    return "\n".join(lines)
