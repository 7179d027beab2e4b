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
