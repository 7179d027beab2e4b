"""The worker's copy of its engines' log files onto its stdout (compose: `docker compose logs`)."""

from __future__ import annotations

import io
from pathlib import Path

from shoal.services.worker.log_follow import LogFollower


def test_copies_only_what_is_appended_in_whole_lines(tmp_path: Path) -> None:
    log = tmp_path / "engine-smol-0.log"
    log.write_bytes(b"an earlier engine's line\n")
    out = io.BytesIO()
    follower = LogFollower(out)
    follower.follow(log, "engine smol-0")
    with open(log, "ab") as f:
        f.write(b'{"service": "engine", "msg": "ready"}\nTraceback (most')
    follower.poll()
    assert out.getvalue() == b'{"service": "engine", "msg": "ready"}\n'
    with open(log, "ab") as f:
        f.write(b" recent call last):\n")
    follower.poll()
    follower.poll()  # nothing new: nothing written twice
    assert out.getvalue().splitlines()[1:] == [
        b"[engine smol-0] Traceback (most recent call last):"]


def test_a_truncated_file_is_followed_from_its_new_end(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    out = io.BytesIO()
    follower = LogFollower(out)
    follower.follow(log, "engine e")  # not there yet: from its start
    log.write_bytes(b"one\ntwo\n")
    follower.poll()
    log.write_bytes(b"x\n")  # shorter than what was read
    follower.poll()
    log.write_bytes(b"x\nthree\n")
    follower.poll()
    assert out.getvalue().splitlines() == [
        b"[engine e] one", b"[engine e] two", b"[engine e] three"]
