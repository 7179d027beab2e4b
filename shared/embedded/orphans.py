"""What a killed `shoal up` left running on a data dir: its embedded servers, found by their
files and ended before a new start."""

from __future__ import annotations

import signal
from pathlib import Path

from shoal.shared.embedded.nats_server import EmbeddedNats
from shoal.shared.embedded.postgres_server import EmbeddedPostgres
from shoal.shared.process import end_process


def end_orphans(data_dir: Path) -> list[str]:
    """End the embedded servers a previous run left on `data_dir` (nats-server on its JetStream
    store, the postmaster of its Postgres); what was ended, in words."""
    ended = []
    for pid in EmbeddedNats.orphans(data_dir / "nats"):
        end_process(pid, signal.SIGTERM)
        ended.append(f"nats-server (pid {pid})")
    pid = EmbeddedPostgres.orphan(data_dir / "postgres")
    if pid is not None:
        end_process(pid, signal.SIGINT, timeout=20.0)
        ended.append(f"postgres (pid {pid})")
    return ended
