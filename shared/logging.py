"""One logging setup for every service: plain or JSON lines, with request and instance ids.

`log_context(request_id=..., instance_id=...)` binds ids to the current task (contextvars), and
every record logged inside carries them, so one request can be followed across a service's logs.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
from collections.abc import Iterator, Mapping
from datetime import datetime, UTC
from types import MappingProxyType

# Read-only default: log_context() sets a new dict, never changes the one it has.
_CONTEXT: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar(
    "shoal_log_context", default=MappingProxyType({}))
_FIELDS = ("request_id", "instance_id", "worker_id", "model")


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _CONTEXT.get().items():
            setattr(record, key, value)
        return True


class _JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        body = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "service": self.service,  # one stream carries several (a worker's engines, compose)
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in _FIELDS:
            if hasattr(record, key):
                body[key] = getattr(record, key)
        if record.exc_info:
            body["exc"] = self.formatException(record.exc_info)
        return json.dumps(body)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = " ".join(f"{k}={getattr(record, k)}" for k in _FIELDS if hasattr(record, k))
        return f"{line} [{extra}]" if extra else line


def setup_logging(level: str = "INFO", json_lines: bool = False, service: str = "shoal") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ContextFilter())
    if json_lines:
        handler.setFormatter(_JsonFormatter(service))
    else:
        fmt = f"%(asctime)s %(levelname)-7s {service} %(name)s: %(message)s"
        handler.setFormatter(_TextFormatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("nats", "asyncio", "aiohttp.access", "httpx", "sqlalchemy.engine"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@contextlib.contextmanager
def log_context(**ids: str) -> Iterator[None]:
    token = _CONTEXT.set({**_CONTEXT.get(), **{k: v for k, v in ids.items() if v is not None}})
    try:
        yield
    finally:
        _CONTEXT.reset(token)
