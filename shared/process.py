"""Child-process helpers shared by `shoal up`, its embedded servers and the worker's engines:
die with the parent, stop a child (signal, wait, kill), find and end a previous run's processes
by their command line."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

PR_SET_PDEATHSIG = 1


def die_with_parent_on(sig: int) -> Callable[[], None]:
    """A preexec_fn: the child gets `sig` when the thread that started it dies (Linux), even by
    SIGKILL, so nothing is orphaned. Postgres wants SIGINT (its fast shutdown); most, SIGTERM."""

    def preexec() -> None:
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)

    return preexec


die_with_parent = die_with_parent_on(signal.SIGTERM)
"""preexec_fn: the child gets SIGTERM when its parent dies."""


class Child(Protocol):
    """What stop_child needs of a process: a Popen, or a worker's adopted engine."""

    def poll(self) -> Any: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> Any: ...


def stop_child(process: Child, sig: int = signal.SIGTERM, timeout: float = 10.0) -> bool:
    """Send `sig` to a child still running, wait up to `timeout` seconds, then SIGKILL it; reaped
    either way. True when it had to be killed."""
    killed = False
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            killed = True
    process.wait()
    return killed


def cmdline(pid: int) -> list[str]:
    """A live process's argv ([] when it is gone, a zombie, or not ours to read)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def find_processes(match: Callable[[list[str]], bool]) -> list[int]:
    """Pids of the processes whose argv satisfies `match` (never this one)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            argv = cmdline(int(entry.name))
            if argv and match(argv):
                found.append(int(entry.name))
    return found


def end_process(pid: int, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
    """Send `sig`, wait up to `timeout` seconds for the process to go, then SIGKILL it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        while alive(pid) and time.monotonic() < deadline + 5:
            time.sleep(0.05)
