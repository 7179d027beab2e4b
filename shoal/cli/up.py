"""`shoal up` and `shoal serve`: start the stack (stack.py), wait until it is ready, deploy a
model and wait until it serves, then supervise the stack until Ctrl-C stops all of it."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
import urllib.request
from collections.abc import Callable
from datetime import datetime, UTC

from shoal.cli.progress import failed_start, wait_running
from shoal.cli.stack import Stack, StartFailed
from shoal.shared.bus.client import Bus
from shoal.shared.bus.deploy import preflight
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.errors import NotFound, ShoalError
from shoal.shared.schemas.registry import InstancePublic, ModelCreate
from shoal.shared.states import InstanceState, WorkerState

READY_TIMEOUT_S = 120.0
MODEL_TIMEOUT_S = 900.0
SCHEDULER_WAIT_S = 30.0
"""How long a deploy waits for this stack's scheduler to answer its dry run."""


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
