"""An instance's progress in its state message: the engine writes "<stage> <pct>%" while it
prepares and loads its model; the CLI reads it back to draw a bar. One module owns the format,
so writer and reader cannot drift apart."""

from __future__ import annotations

import re

PREFIX = "preparing model files: "
_PATTERN = re.compile(r"^(?P<stage>.*?)\s*(?P<pct>\d{1,3})%$")


def progress_message(stage: str, fraction: float) -> str:
    return f"{PREFIX}{stage} {min(max(fraction, 0.0), 1.0):.0%}"


def parse_progress(message: str | None) -> tuple[str, float] | None:
    """(stage, fraction) from a message progress_message wrote; None for any other message."""
    if not message or not message.startswith(PREFIX):
        return None
    match = _PATTERN.match(message[len(PREFIX):])
    if match is None:
        return None
    return match["stage"], min(int(match["pct"]), 100) / 100
