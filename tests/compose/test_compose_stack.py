"""compose.yaml serves: the stack from infra/Dockerfile's image comes up, the host's `shoal`
CLI deploys the bundled model into it, the gateway answers a chat and a streamed chat (the
OpenAI SDK from the host), a worker container that dies comes back with its instance RUNNING,
a recreated worker neither converts the model nor builds the C++ ops again (the cache
volume), and the stack goes on serving, and recording events, when one of its three NATS
servers is killed under traffic (the event stream is replicated on all three). Then a second
worker container (its own network namespace: another host) serves a pipeline-parallel instance
with the first, and the first is cut off (`docker network disconnect`) under a stream: it goes
NOT_READY, its instance RUNNING on the second, and when it is connected again its stale engine
is fenced (stopped; never two copies of the replica). tests/compose/fast-liveness.yaml makes
heartbeats and rescheduling take seconds.
Run by `make compose-test` (SHOAL_COMPOSE_TEST=1: it needs Docker and the image built,
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
SERVICES = ["nats", "nats-2", "nats-3", "postgres", "registry", "scheduler", "worker", "gateway"]
MODEL = "SmolLM2-135M-Instruct"
SHOAL = str(Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin" / "shoal")

pytestmark = [
    pytest.mark.skipif(os.environ.get("SHOAL_COMPOSE_TEST") != "1",
                       reason="needs Docker and the compose image: `make compose-test`"),
    pytest.mark.timeout(3600),
]


def compose(*args: str, check: bool = True, timeout: float = 600) -> str:
    env = dict(os.environ, SHOAL_COMPOSE_NATS_PORT=NATS_PORT,
               SHOAL_COMPOSE_GATEWAY_PORT=GATEWAY_PORT)
    files = ["-f", "compose.yaml", "-f", "tests/compose/fast-liveness.yaml"]
    done = subprocess.run([*COMPOSE, "-p", PROJECT, *files, *args], cwd=ROOT, env=env,
                          text=True,
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


def instances(model: str = MODEL) -> list[dict]:
    done = shoal("instances", "list", "--model", model, "--json", timeout=60)
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


def instance_states() -> list[str]:
    return [i["state"] for i in instances()]


def worker_states() -> dict[str, str]:
    return {w["name"]: w["state"] for w in json.loads(shoal("workers", "list", "--json").stdout)}


def chat(content: str = "What is the capital of France?", model: str = MODEL) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{GATEWAY_PORT}/v1", api_key="none",
                    max_retries=0, timeout=120)
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], temperature=0,
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
    compose("--profile", "two-workers", "down", "-v", "--remove-orphans", check=False)
    try:
        compose("up", "-d", *SERVICES)
        until("the gateway answers", lambda: httpx.get(
            f"http://127.0.0.1:{GATEWAY_PORT}/v1/models", timeout=5).status_code == 200, 300)
        yield
    finally:
        logs = compose("logs", "--no-color", "--tail", "200", check=False)
        (ROOT / "test-output").mkdir(exist_ok=True)
        (ROOT / "test-output" / "compose-logs.txt").write_text(logs)
        compose("--profile", "two-workers", "down", "-v", "--remove-orphans", "-t", "20",
                check=False)


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
    # the first start converts the GGUF and compiles the C++ ops: 5 min on two loaded cores,
    # over 15 when other work crowds them
    done = shoal("models", "deploy", MODEL, "--source", smol, "--device", "cpu", "--wait",
                 timeout=2400)
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


async def _events_stream() -> tuple[str | None, int]:
    """The event stream's leader and last sequence, asked through the published NATS port."""
    import nats

    env = cli_env()
    nc = await nats.connect(env["SHOAL_NATS_URL"], connect_timeout=5, max_reconnect_attempts=1)
    try:
        info = await nc.jetstream().stream_info("SHOAL_EVENTS_compose")
        assert info.config.num_replicas == 3
        return (info.cluster.leader if info.cluster else None), info.state.last_seq
    finally:
        await nc.close()


def test_losing_one_nats_server_under_traffic(stack: None) -> None:
    """Chats run in a loop while a NATS server is killed: the services on it reconnect to the
    others (a chat in flight there may fail, README "What survives what"), every chat started
    from 10 s after the kill succeeds, the registry answers and writes, and its events still
    reach the stream, whose replicas elect a leader among the two servers left."""
    import asyncio
    import threading

    # the previous test left the model running
    until("the instance RUNNING", lambda: instance_states() == ["RUNNING"], 600)
    leader, _ = asyncio.run(_events_stream())
    # the stream's leader, unless it is nats-1 (service `nats`: the port this test talks to)
    victim = leader if leader in ("nats-2", "nats-3") else "nats-3"
    results: list[tuple[float, bool]] = []
    done = threading.Event()

    def traffic() -> None:
        while not done.is_set():
            started = time.monotonic()
            try:
                ok = "Paris" in chat()
            except Exception:  # noqa: BLE001 - counted, judged by when it started
                ok = False
            results.append((started, ok))

    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    until("chats before the kill", lambda: len(results) >= 3, 120, 0.5)
    compose("kill", victim)
    killed = time.monotonic()
    until("10 chats started 10 s after the kill", lambda: sum(
        1 for t, _ in results if t >= killed + 10) >= 10, 300, 1.0)
    done.set()
    thread.join(130)
    after = [ok for t, ok in results if t >= killed + 10]
    assert all(after), f"{after.count(False)} of {len(after)} chats failed after the kill"
    print(f"killed {victim} (the stream's leader was {leader}): {len(results)} chats, "
          f"{sum(1 for _, ok in results if not ok)} failed, the {len(after)} started 10 s or more "
          "after the kill all ok")

    # the registry writes and publishes: the event lands in the stream on the servers left
    _, before = asyncio.run(_events_stream())
    created = shoal("keys", "create", "after-the-kill", timeout=60)
    assert created.returncode == 0, created.stderr
    leader_after, last = until("the event in the stream",
                               lambda: (lambda r: r if r[1] > before else None)(
                                   asyncio.run(_events_stream())), 60, 1.0)
    assert leader_after not in (None, victim)


def _stream_outcome(out: dict[str, object]) -> None:
    """One long streamed chat; how it ended (tokens, error) into `out`."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{GATEWAY_PORT}/v1", api_key="none",
                    max_retries=0, timeout=300)
    out["tokens"] = 0
    try:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count to one hundred."}],
            temperature=0, max_tokens=400, stream=True, extra_body={"ignore_eos": True})
        for chunk in stream:
            out["tokens"] = int(out["tokens"]) + bool(chunk.choices and
                                                      chunk.choices[0].delta.content)
        out["end"] = "complete"
    except Exception as exc:  # noqa: BLE001 - the error event the stream ends with
        out["end"] = f"error: {exc}"


def test_two_worker_hosts_pipeline_and_a_partition(stack: None) -> None:
    """worker-2 joins; SmolLM2 with pp=2 spread over both answers; then worker-1 (serving the
    plain SmolLM2) is disconnected from the network under a stream and connected again."""
    import threading

    compose("--profile", "two-workers", "up", "-d", "--no-deps", "worker-2")
    until("worker-2 READY", lambda: worker_states().get("worker-2") == "READY", 300)
    smol = worker_exec("python -c 'from shoal.services.engine import smollm2_gguf_path; "
                       "print(smollm2_gguf_path())'").strip()
    started = time.monotonic()
    done = shoal("models", "deploy", "smol-pp2", "--source", smol, "--device", "cpu", "--pp",
                 "2", "--placement", "spread", "--max-model-len", "512", "--wait", timeout=2400)
    assert done.returncode == 0, done.stdout + done.stderr
    [pp] = instances("smol-pp2")
    assert pp["pp"] == 2 and {pp["worker_name"]} | {
        s["worker_name"] for s in pp["subordinate_workers"]} == {"worker-1", "worker-2"}, pp
    assert "Paris" in until("a chat across the two hosts", lambda: chat(model="smol-pp2"), 120)
    print(f"pp=2 across worker-1 and worker-2: RUNNING in {time.monotonic() - started:.0f}s")
    assert shoal("models", "delete", "smol-pp2").returncode == 0

    until("the instance RUNNING on worker-1", lambda: [
        (i["worker_name"], i["state"]) for i in instances()] == [("worker-1", "RUNNING")], 600)
    container = compose("ps", "-q", "worker").strip()
    network = f"{PROJECT}_default"
    out: dict[str, object] = {}
    streamer = threading.Thread(target=_stream_outcome, args=(out,), daemon=True)
    streamer.start()
    until("tokens on the stream", lambda: int(out.get("tokens", 0)) >= 5, 120, 0.2)
    subprocess.run(["docker", "network", "disconnect", network, container], check=True)
    cut = time.monotonic()
    until("worker-1 NOT_READY", lambda: worker_states().get("worker-1") == "NOT_READY", 120, 0.5)
    not_ready = time.monotonic() - cut
    streamer.join(180)
    assert "end" in out, "the stream on the cut worker hung"
    until("the instance RUNNING on worker-2", lambda: [
        (i["worker_name"], i["state"]) for i in instances()] == [("worker-2", "RUNNING")], 900)
    moved = time.monotonic() - cut

    subprocess.run(["docker", "network", "connect", "--alias", "worker", network, container],
                   check=True)
    healed = time.monotonic()
    seen: set[tuple[str, str]] = set()

    def stale_engine_gone() -> bool:
        now = instances()
        assert len(now) == 1, f"two copies of one replica: {now}"
        seen.add((now[0]["worker_name"], now[0]["state"]))
        left = compose("exec", "-T", "worker", "sh", "-c",
                       "pgrep -f 'shoal engine' || true").strip()
        return not left

    until("the stale engine on worker-1 stopped", stale_engine_gone, 180, 1.0)
    fenced = time.monotonic() - healed
    assert seen == {("worker-2", "RUNNING")}, seen
    until("worker-1 READY again", lambda: worker_states().get("worker-1") == "READY", 120)
    assert "Paris" in until("a chat after the heal", chat, 120)
    print(f"partition of worker-1: NOT_READY in {not_ready:.0f}s, RUNNING on worker-2 "
          f"{moved:.0f}s after the cut, the stream ended {out['end']!r} after "
          f"{out['tokens']} tokens; the stale engine stopped {fenced:.0f}s after the heal")
