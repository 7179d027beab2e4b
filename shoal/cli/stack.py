"""The processes of `shoal up` (up.py runs them): the whole local stack in the foreground.

Embedded NATS and PostgreSQL when SHOAL_NATS_URL / SHOAL_DATABASE_URL are not set, then one
process per service (each its own session, so the terminal's Ctrl-C reaches only this process,
which stops them in order: front to back, then the servers). Crashed services and embedded
servers are restarted (servers on the same port and files), and everything started here dies
with this process even when it is SIGKILLed (PR_SET_PDEATHSIG). One `shoal up` per data dir (a
lock held while it runs); a start first ends what a killed run left behind.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from shoal.shared.config import Settings
from shoal.shared.embedded import (
    Credentials, EmbeddedNats, EmbeddedPostgres, end_orphans, read_stack_file, write_stack_file,
)
from shoal.shared.process import die_with_parent, stop_child

STOP_TIMEOUT_S = 40.0


class StartFailed(Exception):
    """The stack cannot start (another one runs on the data dir, a service died at start)."""


@dataclass
class Child:
    name: str
    argv: list[str]
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    exited_at: float | None = None

    def start(self, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(self.argv, env=env, start_new_session=True,
                                        preexec_fn=die_with_parent)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        if stop_child(self.process, signal.SIGTERM, STOP_TIMEOUT_S):
            print(f"shoal: {self.name} did not stop in {STOP_TIMEOUT_S:.0f}s; killed it",
                  flush=True)


@dataclass
class Server:
    """An embedded server under supervision: restarted with back-off when it dies."""

    name: str
    server: EmbeddedNats | EmbeddedPostgres
    restarts: int = 0
    next_try: float = 0.0

    def supervise(self, now: float) -> None:
        if self.server.alive or now < self.next_try:
            return
        code = self.server.process.returncode
        print(f"shoal: embedded {self.name} exited with {code}; restarting it "
              f"(same port, same files)", flush=True)
        started = time.monotonic()
        try:
            self.server.restart()
        except (OSError, RuntimeError, TimeoutError) as exc:
            self.restarts += 1
            delay = min(30.0, 2.0 ** min(self.restarts, 5))
            self.next_try = time.monotonic() + delay
            print(f"shoal: embedded {self.name} did not restart ({exc}); trying again in "
                  f"{delay:.0f}s", flush=True)
            return
        self.restarts = 0
        print(f"shoal: embedded {self.name} is back at {self.server.public_url} after "
              f"{time.monotonic() - started:.1f}s", flush=True)


@dataclass
class Stack:
    settings: Settings
    services: list[str]
    extra_args: dict[str, list[str]] = field(default_factory=dict)
    nats: EmbeddedNats | None = None
    postgres: EmbeddedPostgres | None = None
    children: list[Child] = field(default_factory=list)
    servers: list[Server] = field(default_factory=list)
    lock_fd: int | None = None

    def claim_data_dir(self) -> None:
        """Hold <data_dir>/up.lock while running (the kernel drops it when this process dies,
        however it dies); then end the servers a killed run left on these files."""
        data = self.settings.data_dir
        data.mkdir(parents=True, exist_ok=True)
        fd = os.open(data / "up.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            owner = read_stack_file(self.settings.stack_file).get("pid", "?")
            raise StartFailed(f"another `shoal up` (pid {owner}) runs on {data}: stop it first, "
                              "or give this one another SHOAL_DATA_DIR") from None
        self.lock_fd = fd
        stale = read_stack_file(self.settings.stack_file)
        if stale:
            print(f"shoal: the previous run on {data} (pid {stale.get('pid', '?')}) did not stop "
                  "cleanly; cleaning up after it", flush=True)
        from shoal.services.worker.engines import end_engines_left

        for what in end_orphans(data) + end_engines_left(data):
            print(f"shoal: stopped {what}, left running by a previous run", flush=True)
        self.settings.stack_file.unlink(missing_ok=True)

    def start_servers(self) -> tuple[str, str]:
        self.claim_data_dir()
        data = self.settings.data_dir
        nats_url = self.settings.nats_url
        database_url = self.settings.database_url
        credentials = None if nats_url and database_url else Credentials.load_or_create(data)
        if not nats_url:
            self.nats = EmbeddedNats.start(data / "nats", port=4222, credentials=credentials)
            self.servers.append(Server("NATS", self.nats))
            nats_url = self.nats.url
            print(f"shoal: embedded NATS at {self.nats.public_url}", flush=True)
        if not database_url:
            self.postgres = EmbeddedPostgres.start(data / "postgres", credentials=credentials)
            self.servers.append(Server("PostgreSQL", self.postgres))
            database_url = self.postgres.url
            print(f"shoal: embedded PostgreSQL at {self.postgres.public_url}", flush=True)
        if credentials is not None:
            print(f"shoal: credentials in {data / 'credentials.json'} (0600)", flush=True)
        gateway_url = f"http://{self.settings.gateway_host}:{self.settings.gateway_port}"
        write_stack_file(self.settings.stack_file, nats_url, database_url,
                         gateway_url=gateway_url, namespace=self.settings.ns, pid=os.getpid())
        print(f"shoal: namespace {self.settings.ns} (NATS subjects shoal.{self.settings.ns}.*)",
              flush=True)
        self.settings = self.settings.model_copy(update={"nats_url": nats_url,
                                                         "database_url": database_url})
        return nats_url, database_url

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(SHOAL_NATS_URL=str(self.settings.nats_url),
                   SHOAL_DATABASE_URL=str(self.settings.database_url),
                   SHOAL_DATA_DIR=str(self.settings.data_dir),
                   SHOAL_NAMESPACE=self.settings.ns,
                   SHOAL_GATEWAY_HOST=self.settings.gateway_host,
                   SHOAL_GATEWAY_PORT=str(self.settings.gateway_port))
        if self.settings.api_key:
            env["SHOAL_API_KEY"] = self.settings.api_key
        return env

    def start_services(self) -> None:
        env = self.env()
        for name in self.services:
            child = Child(name,
                          [sys.executable, "-m", "shoal", name, *self.extra_args.get(name, [])])
            child.start(env)
            self.children.append(child)

    def failed_child(self) -> Child | None:
        """A service that has exited (while the stack starts, that is fatal)."""
        return next((c for c in self.children
                     if c.process is not None and c.process.poll() is not None), None)

    def supervise_once(self) -> None:
        """Restart a dead embedded server, then a crashed service, with back-off (1 s doubling
        to 30 s)."""
        now = time.monotonic()
        for server in self.servers:
            server.supervise(now)
        now = time.monotonic()
        for child in self.children:
            if child.process is None or child.process.poll() is None:
                continue
            if child.exited_at is None:
                child.exited_at = now
                print(f"shoal: {child.name} exited with {child.process.returncode}", flush=True)
            if now - child.exited_at >= min(30.0, 2.0 ** min(child.restarts, 5)):
                print(f"shoal: restarting {child.name}", flush=True)
                child.restarts += 1
                child.exited_at = None
                child.start(self.env())

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop()
        if self.nats is not None:
            self.nats.stop()
        if self.postgres is not None:
            self.postgres.stop()
        if self.lock_fd is not None:  # only the owner of the data dir removes its stack file
            self.settings.stack_file.unlink(missing_ok=True)
            os.close(self.lock_fd)
            self.lock_fd = None
