"""Engine logs on the agent's stdout, for container runtimes (SHOAL_WORKER_ENGINE_LOG_STDOUT).

An engine writes to its own log file (<data_dir>/logs/engine-<instance>.log), not to the agent's
stdout, because it outlives the agent (supervisor.py) and the agent reads the file's tail when
it crashes. Under compose the agent's stdout is what `docker compose logs` shows, so the agent
copies what each engine appends there as it comes: JSON lines as they are (they name their
service, `engine`, and its instance), other lines (a traceback, a native library's output)
prefixed with the instance's name.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

CHUNK = 1 << 20
"""At most this much of one file per pass: a burst is copied over several passes."""


@dataclass
class _Followed:
    label: bytes
    offset: int
    partial: bytes = field(default=b"")


class LogFollower:
    def __init__(self, out: BinaryIO | None = None) -> None:
        self.out = out if out is not None else sys.stdout.buffer
        self.files: dict[Path, _Followed] = {}

    def follow(self, path: Path, label: str) -> None:
        """Copy what is appended to `path` from now on (not what it holds already)."""
        try:
            offset = path.stat().st_size
        except OSError:
            offset = 0
        self.files[path] = _Followed(f"[{label}] ".encode(), offset)

    def poll(self) -> None:
        """Copy the complete lines appended since the last pass (a file that shrank, rotated by
        hand, is followed from its new end)."""
        wrote = False
        for path, state in self.files.items():
            try:
                with open(path, "rb") as f:
                    size = f.seek(0, 2)
                    if size < state.offset:
                        state.offset, state.partial = size, b""
                    f.seek(state.offset)
                    data = f.read(CHUNK)
            except OSError:
                continue
            state.offset += len(data)
            *lines, state.partial = (state.partial + data).split(b"\n")
            for line in lines:
                self.out.write(line + b"\n" if line.startswith(b"{") else
                               state.label + line + b"\n")
                wrote = True
        if wrote:
            self.out.flush()
