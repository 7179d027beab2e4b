"""The engine processes of a worker: the one it started (a child) or adopted (left running by a
previous agent, watched through /proc), and the records under <data_dir>/engines/ by which the
next agent finds them (or a new `shoal up` ends them)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from shoal.shared.process import alive, cmdline


class AdoptedProcess:
    """An engine started by a previous agent: not our child, so watched through /proc (its exit
    status is unknown: it was reaped by init)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | str | None = None

    def poll(self) -> int | str | None:
        if self.returncode is None and not alive(self.pid):
            self.returncode = "an unknown status (adopted)"
        return self.returncode

    def send_signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int | str | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            time.sleep(0.1)
        return self.returncode


@dataclass
class EngineProcess:
    instance_id: str
    process: subprocess.Popen[bytes] | AdoptedProcess
    log_path: Path
    started_at: float
    generation: int | None = None
    """The placement it was started for (InstancePublic.placement_generation); None: adopted
    from a record written before generations were kept."""

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 8) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def running_engines(data_dir: Path, worker_name: str) -> dict[str, EngineProcess]:
    """The engines a previous agent of worker `worker_name` started from this data dir and that
    still run (a record whose process is gone is removed)."""
    records = data_dir / "engines"
    found: dict[str, EngineProcess] = {}
    for path in sorted(records.glob("*.json")) if records.is_dir() else []:
        try:
            record = json.loads(path.read_text())
            pid, name = int(record["pid"]), str(record["worker_name"])
        except (OSError, ValueError, KeyError, TypeError):
            path.unlink(missing_ok=True)
            continue
        if name != worker_name:
            continue
        argv = cmdline(pid)
        if not (alive(pid) and "engine" in argv and path.stem in argv):
            path.unlink(missing_ok=True)
            continue
        generation = record.get("generation")
        found[path.stem] = EngineProcess(path.stem, AdoptedProcess(pid),
                                         Path(record.get("log_path", "")), time.monotonic(),
                                         None if generation is None else int(generation))
    return found


def end_engines_left(data_dir: Path) -> list[str]:
    """End every engine recorded under `data_dir` (a killed `shoal up` left them, connected to
    servers that are gone); what was ended, in words."""
    from shoal.shared.process import end_process

    ended = []
    records = data_dir / "engines"
    for path in sorted(records.glob("*.json")) if records.is_dir() else []:
        try:
            pid = int(json.loads(path.read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            pid = 0
        argv = cmdline(pid) if pid else []
        if pid and alive(pid) and "engine" in argv and path.stem in argv:
            end_process(pid, signal.SIGTERM, timeout=15.0)
            ended.append(f"the engine of instance {path.stem} (pid {pid})")
        path.unlink(missing_ok=True)
    return ended
