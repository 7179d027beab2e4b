"""The files a local stack keeps under its data dir, readable by their owner only (0600): the
embedded servers' credentials and stack.json (the URLs every service and the CLI connect to)."""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by its owner only (0600), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.chmod(tmp, 0o600)
    tmp.replace(path)


@dataclass(frozen=True)
class Credentials:
    """The embedded servers' secrets: made at first start, kept in <data_dir>/credentials.json
    (0600), handed to every service and the CLI inside the URLs of stack.json (0600 too)."""

    nats_user: str
    nats_password: str
    postgres_password: str

    @classmethod
    def load_or_create(cls, data_dir: Path) -> Credentials:
        path = data_dir / "credentials.json"
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            pass
        made = cls("shoal", secrets.token_urlsafe(24), secrets.token_urlsafe(24))
        write_private(path, json.dumps(asdict(made), indent=2))
        return made


def write_stack_file(path: Path, nats_url: str, database_url: str, **extra: object) -> None:
    """stack.json, 0600: its URLs carry the embedded servers' credentials."""
    write_private(path, json.dumps({"nats_url": nats_url, "database_url": database_url, **extra},
                                   indent=2))


def read_stack_file(path: Path) -> dict[str, object]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}
