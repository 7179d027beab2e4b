"""`shoal up` on embedded servers: reaches a READY worker, the CLI lists it, and Ctrl-C
(SIGINT) stops every process it started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from shoal.shared.embedded import free_port

pytestmark = pytest.mark.e2e


def _env(data_dir: Path, gateway_port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["SHOAL_DATA_DIR"] = str(data_dir)
    env["SHOAL_HEARTBEAT_INTERVAL"] = "1"
    env["SHOAL_GATEWAY_PORT"] = str(gateway_port)
    return env


def _started_by(root: psutil.Process, data_dir: Path) -> set[int]:
    pids = {p.pid for p in root.children(recursive=True)}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if str(data_dir) in " ".join(proc.info["cmdline"] or []):
            pids.add(proc.info["pid"])
    return pids


def _gateway_healthy(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            time.sleep(0.3)
    return False


def test_up_ready_then_ctrl_c_leaves_nothing(tmp_path: Path) -> None:
    data_dir = tmp_path / "stack"
    port = free_port()
    env = _env(data_dir, port)
    up = subprocess.Popen([sys.executable, "-m", "shoal", "up", "--simulate-devices", "1xA10-24GB"],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    try:
        deadline = time.monotonic() + 120
        assert up.stdout is not None
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line:
                break
            output.append(line)
            if "shoal: ready" in line:
                break
        assert any("shoal: ready" in line for line in output), "".join(output)

        listed = subprocess.run([sys.executable, "-m", "shoal", "workers", "list", "--json"],
                                env=env,
                                capture_output=True, text=True, timeout=60, check=True)
        workers = json.loads(listed.stdout)
        assert [w["state"] for w in workers] == ["READY"] and workers[0]["simulated"] is True
        table = subprocess.run([sys.executable, "-m", "shoal", "workers", "list"], env=env,
                               capture_output=True, text=True, timeout=60, check=True).stdout
        assert "(simulated)" in table and "READY" in table

        assert _gateway_healthy(port, timeout=30), "the gateway never answered /health"
        spawned = _started_by(psutil.Process(up.pid), data_dir)
        # nats-server, postgres, registry, scheduler, worker, gateway
        assert len(spawned) >= 6, spawned
    finally:
        up.send_signal(signal.SIGINT)
        rest, _ = up.communicate(timeout=60)
        output.append(rest)
    assert up.returncode == 0, "".join(output)
    assert "shoal: stopped" in "".join(output)
    time.sleep(0.5)
    alive = [pid for pid in spawned
             if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left behind: {[psutil.Process(p).cmdline() for p in alive]}"
    assert not (data_dir / "stack.json").exists()


def _start(env: dict[str, str], *args: str) -> tuple[subprocess.Popen[str], list[str]]:
    """`shoal up` (simulated worker), read until it is ready or exits."""
    up = subprocess.Popen([sys.executable, "-m", "shoal", "up", "--simulate-devices", "1xA10-24GB",
                           *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    output: list[str] = []
    assert up.stdout is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = up.stdout.readline()
        if not line:
            break
        output.append(line)
        if "shoal: ready" in line:
            break
    return up, output


def test_up_dies_whole_when_killed_and_the_next_start_cleans_up(tmp_path: Path) -> None:
    """(Its servers' restarts are tested under load in test_chaos.py.)"""
    data_dir = tmp_path / "stack"
    port = free_port()
    env = _env(data_dir, port)
    up, output = _start(env)
    try:
        assert any("shoal: ready" in line for line in output), "".join(output)
        assert (data_dir / "credentials.json").stat().st_mode & 0o077 == 0
        assert (data_dir / "stack.json").stat().st_mode & 0o077 == 0
        assert _gateway_healthy(port, timeout=30)
        # SIGKILL `shoal up`: its servers and services die with it
        spawned = _started_by(psutil.Process(up.pid), data_dir)
        assert len(spawned) >= 6, spawned
        up.kill()
        up.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(
                psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                for p in spawned):
            time.sleep(0.2)
        left = [p for p in spawned if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert not left, f"left behind: {[psutil.Process(p).cmdline() for p in left]}"
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    # a leftover server on the same JetStream store (as an older run could leave) is ended
    stray = subprocess.Popen([str(Path(sys.executable).parent / "nats-server"), "-js", "-p", "-1",
                              "-sd", str(data_dir / "nats" / "jetstream")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    again, output = _start(env)
    try:
        text = "".join(output)
        assert "did not stop cleanly" in text and "shoal: ready" in text, text
        assert f"stopped nats-server (pid {stray.pid})" in text, text
        stray.wait(10)
        # a second `shoal up` on the same data dir is refused, and leaves the first alone
        second = subprocess.run([sys.executable, "-m", "shoal", "up", "--no-model"], env=env,
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and "another `shoal up`" in second.stdout, second.stdout
        assert (data_dir / "stack.json").exists()
    finally:
        again.send_signal(signal.SIGINT)
        again.communicate(timeout=60)
    assert again.returncode == 0


def test_up_fails_when_a_service_dies_at_start(tmp_path: Path) -> None:
    """The gateway cannot bind its port: `shoal up` says so and exits 1, never "ready"."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = _env(tmp_path / "stack", taken.getsockname()[1])
        up, output = _start(env)
        rest, _ = up.communicate(timeout=60)
    text = "".join(output) + rest
    assert up.returncode == 1, text
    assert "shoal: ready" not in text and "gateway exited with" in text, text
