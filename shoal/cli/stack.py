"""`shoal up`: the whole local stack in the foreground, and Ctrl-C stops all of it.

Embedded NATS and PostgreSQL when SHOAL_NATS_URL / SHOAL_DATABASE_URL are not set, then one
process per service (each its own session, so the terminal's Ctrl-C reaches only this process,
which stops them in order: front to back, then the servers). Crashed services are restarted.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, UTC

from shoal.shared.process import die_with_parent
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.embedded import EmbeddedNats, EmbeddedPostgres, write_stack_file
from shoal.shared.errors import NotFound, ShoalError
from shoal.cli.progress import wait_running
from shoal.shared.schemas.registry import InstancePublic, ModelCreate
from shoal.shared.states import WorkerState

STOP_TIMEOUT_S = 40.0
READY_TIMEOUT_S = 120.0
MODEL_TIMEOUT_S = 900.0


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
class Stack:
    settings: Settings
    services: list[str]
    extra_args: dict[str, list[str]] = field(default_factory=dict)
    nats: EmbeddedNats | None = None
    postgres: EmbeddedPostgres | None = None
    children: list[Child] = field(default_factory=list)

    def start_servers(self) -> tuple[str, str]:
        data = self.settings.data_dir
        nats_url = self.settings.nats_url
        if not nats_url:
            self.nats = EmbeddedNats.start(data / "nats", port=4222)
            nats_url = self.nats.url
            print(f"shoal: embedded NATS at {nats_url}", flush=True)
        database_url = self.settings.database_url
        if not database_url:
            self.postgres = EmbeddedPostgres.start(data / "postgres")
            database_url = self.postgres.url
            print(f"shoal: embedded PostgreSQL at {database_url}", flush=True)
        gateway_url = f"http://{self.settings.gateway_host}:{self.settings.gateway_port}"
        write_stack_file(self.settings.stack_file, nats_url, database_url,
                         gateway_url=gateway_url, namespace=self.settings.ns)
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

    def supervise_once(self) -> None:
        """Restart a crashed service, with back-off (1 s doubling to 30 s)."""
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
        self.settings.stack_file.unlink(missing_ok=True)


DEFAULT_MODEL = "SmolLM2-135M-Instruct"


async def deploy_and_wait(settings: Settings, spec: ModelCreate, deadline: float,
                          stopping: Callable[[], bool], since: datetime) -> InstancePublic | None:
    """Deploy `spec` (unless a model of that name exists) and wait for a RUNNING instance,
    showing its progress. None when stopped or timed out (the stack keeps running)."""
    bus = await Bus.connect(settings, name="shoal-up")
    try:
        client = RegistryClient(bus)
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


async def wait_ready(settings: Settings, deadline: float, since: datetime) -> str:
    """Until the registry answers and a worker is READY with a heartbeat from this run (a row
    left READY by a previous run does not count); returns the worker's name."""
    bus = await Bus.connect(settings, name="shoal-up")
    try:
        client = RegistryClient(bus)
        while time.monotonic() < deadline:
            try:
                ready = [w for w in await client.list_workers() if w.state is WorkerState.READY
                         and w.last_heartbeat_at is not None and w.last_heartbeat_at >= since]
                if ready:
                    return ready[0].name
            except ShoalError:
                pass
            await asyncio.sleep(0.2)
        raise TimeoutError("the stack did not become ready in time")
    finally:
        await bus.close()


def up(settings: Settings, services: list[str], extra_args: dict[str, list[str]],
       model: ModelCreate | None = None) -> int:
    """Run the stack; with `model`, deploy it and wait until it serves."""
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
    try:
        stack.start_servers()
        stack.start_services()
        worker = asyncio.run(wait_ready(stack.settings, started + READY_TIMEOUT_S, since))
        is_ready = True
        print(f"shoal: ready in {time.monotonic() - started:.1f}s — worker {worker} READY; "
              f"data in {settings.data_dir}", flush=True)
        if "gateway" in services:
            base = f"http://{settings.gateway_host}:{settings.gateway_port}"
            print(f"shoal: dashboard {base}/  (API docs {base}/docs)", flush=True)
        if model is not None:
            instance = asyncio.run(deploy_and_wait(stack.settings, model,
                                                   time.monotonic() + MODEL_TIMEOUT_S,
                                                   lambda: stopping, since))
            if instance is not None:
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
    finally:
        print("shoal: stopping...", flush=True)
        stack.stop()
        print("shoal: stopped", flush=True)
    return 0


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
