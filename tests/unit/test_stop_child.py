"""stop_child: the one way a child is stopped (embedded NATS and Postgres, `shoal up`'s services,
the worker's engines): the signal, a wait, SIGKILL for one that ignores it, reaped either way."""

from __future__ import annotations

import signal
import subprocess
import sys

from shoal.shared.process import stop_child


def _child(code: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"  # handlers are set
    return proc


def test_a_child_that_obeys_is_not_killed() -> None:
    proc = _child("import time; print('up', flush=True); time.sleep(60)")
    assert stop_child(proc, signal.SIGTERM, timeout=10) is False
    assert proc.returncode == -signal.SIGTERM


def test_a_child_that_ignores_the_signal_is_killed_and_reaped() -> None:
    proc = _child("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "print('up', flush=True); time.sleep(60)")
    assert stop_child(proc, signal.SIGTERM, timeout=0.5) is True
    assert proc.returncode == -signal.SIGKILL


def test_a_child_already_gone_is_only_reaped() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert stop_child(proc) is False and proc.returncode == 0
