"""Private, throw-away PostgreSQL clusters for ``outbox demo`` and the test suite.

A default PostgreSQL install has prepared transactions disabled, so the demo and
the tests start their own cluster (initdb in a temporary folder) with
``max_prepared_transactions`` set, on a free port of 127.0.0.1.  The binaries are
the installed server's (``pg_config --bindir`` or ``/usr/lib/postgresql/*/bin``).
PostgreSQL refuses to run as root; as root the cluster runs as ``postgres``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence

from outbox.errors import OutboxError


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Starts tried, each on another port, when the server could not bind its port.
PORT_ATTEMPTS = 3


def _tail(path: str, lines: int = 8) -> str:
    """The last lines of the server's log, for an error message."""
    try:
        with open(path, errors="replace") as log:
            return " | ".join(log.read().strip().splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"


def postgres_bindir() -> str:
    candidates = []
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True)
        if out.returncode == 0:
            candidates.append(out.stdout.strip())
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for path in candidates:
        if os.path.exists(os.path.join(path, "initdb")):
            return path
    raise OutboxError(
        "no PostgreSQL server binaries found (initdb)",
        "install the PostgreSQL server package (e.g. apt-get install postgresql), "
        "or pass --dsn to a server with max_prepared_transactions > 0",
    )


class PostgresCluster:
    """A private PostgreSQL cluster; ``start()`` returns its DSN."""

    def __init__(
        self,
        base_dir: str | None = None,
        *,
        port: int | None = None,
        durable: bool = True,
        max_prepared_transactions: int = 64,
        extra_settings: dict[str, str] | None = None,
    ) -> None:
        self._own_dir = base_dir is None
        self.base_dir = base_dir or tempfile.mkdtemp(prefix="outbox-pg-")
        self.data_dir = os.path.join(self.base_dir, "data")
        self.port = port or free_port()
        self.bindir = postgres_bindir()
        self.settings = {
            "max_prepared_transactions": str(max_prepared_transactions),
            "max_connections": "200",
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            "unix_socket_directories": self.base_dir,
            "log_min_messages": "warning",
        }
        if not durable:
            # Tests only: a killed server process still loses nothing (the OS has
            # the pages); only a power cut would.
            self.settings.update(fsync="off", full_page_writes="off")
        self.settings.update(extra_settings or {})
        self._user = "postgres" if os.geteuid() == 0 else None

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        command = [os.path.join(self.bindir, args[0]), *args[1:]]
        if self._user:
            command = ["runuser", "-u", self._user, "--", *command]
        result = subprocess.run(command, capture_output=True, text=True)
        if check and result.returncode != 0:
            raise OutboxError(
                f"{args[0]} failed: {(result.stderr or result.stdout).strip()[-800:]}"
            )
        return result

    def start(self) -> str:
        if not os.path.exists(os.path.join(self.data_dir, "PG_VERSION")):
            os.makedirs(self.data_dir, exist_ok=True)
            if self._user:
                entry = pwd.getpwnam(self._user)
                for path in (self.base_dir, self.data_dir):
                    os.chown(path, entry.pw_uid, entry.pw_gid)
            self._run(
                [
                    "initdb",
                    "-D",
                    self.data_dir,
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "--no-sync",
                    "-E",
                    "UTF8",
                    "--locale=C",
                ]
            )
            with open(os.path.join(self.data_dir, "postgresql.auto.conf"), "a") as conf:
                for key, value in self.settings.items():
                    conf.write(f"{key} = '{value}'\n")
        log = os.path.join(self.base_dir, "log")
        for attempt in range(PORT_ATTEMPTS):
            start = ["pg_ctl", "-D", self.data_dir, "-l", log, "-w", "-t", "60", "start"]
            if self._run(start, check=False).returncode == 0:
                break
            tail = _tail(log)
            if "could not bind" not in tail or attempt == PORT_ATTEMPTS - 1:
                raise OutboxError(f"pg_ctl could not start the server: {tail}")
            # ``free_port`` found the port free, and another process took it before
            # the server bound it (suites running side by side): take another one.
            self.port = free_port()
            with open(os.path.join(self.data_dir, "postgresql.auto.conf"), "a") as conf:
                conf.write(f"port = '{self.port}'\n")
        self._wait_ready()
        return self.dsn

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (
                self._run(
                    ["pg_isready", "-h", "127.0.0.1", "-p", str(self.port)], check=False
                ).returncode
                == 0
            ):
                return
            time.sleep(0.1)
        raise OutboxError(f"private PostgreSQL on port {self.port} did not become ready")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server; ``mode="immediate"`` is a crash (recovery on next start)."""
        self._run(["pg_ctl", "-D", self.data_dir, "-m", mode, "-w", "stop"], check=False)

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def destroy(self) -> None:
        self.stop("immediate")
        if self._own_dir:
            with contextlib.suppress(OSError):
                shutil.rmtree(self.base_dir)

    def __enter__(self) -> PostgresCluster:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.destroy()


def standby_of(
    primary_dsn: str,
    *,
    backup_options: Sequence[str] = (),
    settings: dict[str, str] | None = None,
    durable: bool = True,
    max_prepared_transactions: int = 64,
) -> PostgresCluster:
    """Base-backup the server at ``primary_dsn`` (``pg_basebackup -R -X stream``,
    plus ``backup_options``) into a new folder and start it as a streaming standby
    on a port of its own, with ``settings`` added to its configuration.  The
    caller destroys it (``destroy()`` removes the folder)."""
    base = tempfile.mkdtemp(prefix="outbox-pg-standby-")
    data = os.path.join(base, "data")
    command = [
        os.path.join(postgres_bindir(), "pg_basebackup"),
        *("-d", primary_dsn, "-D", data, "-R", "-X", "stream", "--no-sync"),
        "--checkpoint=fast",  # a spread checkpoint kept the backup waiting 1.5-2 minutes
        *backup_options,
    ]
    if os.geteuid() == 0:
        entry = pwd.getpwnam("postgres")
        os.chown(base, entry.pw_uid, entry.pw_gid)
        command = ["runuser", "-u", "postgres", "--", *command]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(base, ignore_errors=True)
        raise OutboxError(f"pg_basebackup failed: {done.stderr.strip()[-800:]}")
    port = free_port()
    with open(os.path.join(data, "postgresql.auto.conf"), "a") as conf:
        for name, value in {
            "port": str(port),
            "unix_socket_directories": base,
            **(settings or {}),
        }.items():
            conf.write(f"{name} = '{value}'\n")
    # start() finds PG_VERSION and runs pg_ctl on the backup as it is.
    standby = PostgresCluster(
        base, port=port, durable=durable, max_prepared_transactions=max_prepared_transactions
    )
    standby._own_dir = True
    standby.start()
    return standby
