"""compose.yaml serves: the stack from infra/Dockerfile's image comes up, the host's `shoal`
CLI deploys the bundled model into it, the gateway answers a chat and a streamed chat (the
OpenAI SDK from the host), a worker container that dies comes back with its instance RUNNING,
and a recreated worker neither converts the model nor builds the C++ ops again (the cache
volume). Run by `make compose-test` (SHOAL_COMPOSE_TEST=1: it needs Docker and the image built,
a few minutes), never by `make test`; the stack is torn down with its volumes at the end.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = shlex.split(os.environ.get("COMPOSE", "docker compose"))
PROJECT = os.environ.get("SHOAL_COMPOSE_PROJECT", "shoal-compose-test")
NATS_PORT = os.environ.get("SHOAL_COMPOSE_NATS_PORT", "14222")
GATEWAY_PORT = os.environ.get("SHOAL_COMPOSE_GATEWAY_PORT", "18000")
SERVICES = ["nats", "postgres", "registry", "scheduler", "worker", "gateway"]
MODEL = "SmolLM2-135M-Instruct"
SHOAL = str(Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin" / "shoal")

pytestmark = [
    pytest.mark.skipif(os.environ.get("SHOAL_COMPOSE_TEST") != "1",
                       reason="needs Docker and the compose image: `make compose-test`"),
    pytest.mark.timeout(1800),
]


def compose(*args: str, check: bool = True, timeout: float = 600) -> str:
    env = dict(os.environ, SHOAL_COMPOSE_NATS_PORT=NATS_PORT,
               SHOAL_COMPOSE_GATEWAY_PORT=GATEWAY_PORT)
    done = subprocess.run([*COMPOSE, "-p", PROJECT, *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(args)}: {done.returncode}\n{done.stdout}{done.stderr}")
    return done.stdout


def cli_env(namespace: bool = True) -> dict[str, str]:
    """What README tells a user: `eval "$(infra/compose-env.sh)"` (here without the
    namespace when asked, and a data dir of its own: no local stack's stack.json is read)."""
    out = subprocess.run([str(ROOT / "infra/compose-env.sh")], check=True, text=True,
                         capture_output=True, env=dict(os.environ,
                                                       SHOAL_COMPOSE_NATS_PORT=NATS_PORT)).stdout
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    for line in out.splitlines():
        key, value = line.removeprefix("export ").split("=", 1)
        env[key] = shlex.split(value)[0]
    if not namespace:
        env.pop("SHOAL_NAMESPACE")
    env["SHOAL_DATA_DIR"] = "/nonexistent/shoal-compose-test"
    return env


def shoal(*args: str, namespace: bool = True, timeout: float = 900
          ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SHOAL, *args], env=cli_env(namespace), text=True,
                          capture_output=True, timeout=timeout)


def until(what: str, check, timeout: float, every: float = 2.0):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except Exception as exc:  # noqa: BLE001 - keep polling; the last failure is reported
            last = exc
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout:.0f}s (last: {last!r})")


def instance_states() -> list[str]:
    done = shoal("instances", "list", "--model", MODEL, "--json", timeout=60)
    assert done.returncode == 0, done.stderr
    return [i["state"] for i in json.loads(done.stdout)]


def chat(content: str = "What is the capital of France?") -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{GATEWAY_PORT}/v1", api_key="none",
                    max_retries=0, timeout=120)
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], temperature=0,
        max_tokens=16)
    return answer.choices[0].message.content or ""


def worker_exec(script: str) -> str:
    return compose("exec", "-T", "worker", "sh", "-c", script)


def cache_listing() -> str:
    """The converted model and the built C++ ops in the worker's cache volume, with mtimes."""
    return worker_exec("cd /var/cache/shoal && find models torch_extensions -maxdepth 2 "
                       "\\( -name config.json -o -name '*.so' \\) -printf '%p %T@\\n' | sort")


@pytest.fixture(scope="module")
def stack() -> Iterator[None]:
    compose("down", "-v", "--remove-orphans", check=False)
    try:
        compose("up", "-d", *SERVICES)
        until("the gateway answers", lambda: httpx.get(
            f"http://127.0.0.1:{GATEWAY_PORT}/v1/models", timeout=5).status_code == 200, 300)
        yield
    finally:
        logs = compose("logs", "--no-color", "--tail", "200", check=False)
        (ROOT / "test-output").mkdir(exist_ok=True)
        (ROOT / "test-output" / "compose-logs.txt").write_text(logs)
        compose("down", "-v", "--remove-orphans", "-t", "20", check=False)


def test_the_cli_names_the_namespace_it_missed(stack: None) -> None:
    done = shoal("workers", "list", namespace=False, timeout=60)
    assert done.returncode == 1
    assert "SHOAL_NAMESPACE=compose" in done.stderr, done.stderr


def test_deploy_chat_stream_and_a_worker_that_dies(stack: None) -> None:
    smol = worker_exec("python -c 'from shoal.services.engine import smollm2_gguf_path; "
                       "print(smollm2_gguf_path())'").strip()
    until("the worker registers", lambda: [w["state"] for w in json.loads(
        shoal("workers", "list", "--json").stdout)] == ["READY"], 120)
    started = time.monotonic()
    done = shoal("models", "deploy", MODEL, "--source", smol, "--device", "cpu", "--wait")
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"deployed and RUNNING in {time.monotonic() - started:.0f}s")

    assert "Paris" in chat()
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{GATEWAY_PORT}/v1", api_key="none",
                    max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to five."}], temperature=0,
        max_tokens=24, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(pieces) > 3 and "".join(pieces).strip()

    # the engine's own lines reach `docker compose logs`, and it runs the C++ CPU ops
    logs = compose("logs", "--no-color", "worker")
    assert '"service": "engine"' in logs or '"service":"engine"' in logs, logs[-3000:]
    assert "C++ ops unavailable" not in logs, logs[-3000:]
    cached = cache_listing()
    assert "models/" in cached and "shoal_cpu_ops.so" in cached, cached

    # the worker container dies (its agent SIGKILLed: tini, its PID 1, exits with it) and
    # `restart: unless-stopped` brings it back; the instance is RUNNING again and answers
    compose("exec", "-T", "worker", "python", "-c", "import os\nfor p in os.listdir('/proc'):\n"
            "    if p.isdigit() and b'shoal\\x00worker\\x00' in open(f'/proc/{p}/cmdline', 'rb')"
            ".read():\n        os.kill(int(p), 9)", check=False)
    killed = time.monotonic()
    until("the instance leaves RUNNING", lambda: instance_states() != ["RUNNING"], 120, 0.5)
    until("the instance is RUNNING again", lambda: instance_states() == ["RUNNING"], 600)
    assert "Paris" in until("a chat after the restart", chat, 120)
    print(f"worker container killed: RUNNING again in {time.monotonic() - killed:.0f}s")

    # a recreated worker (a new container) starts from the cache volume: same files
    compose("up", "-d", "--no-deps", "--force-recreate", "worker")
    until("the instance leaves RUNNING", lambda: instance_states() != ["RUNNING"], 120, 0.5)
    until("the instance is RUNNING again", lambda: instance_states() == ["RUNNING"], 600)
    assert cache_listing() == cached
    assert "Paris" in until("a chat after the recreate", chat, 120)
