"""A private RabbitMQ node on free ports, for what must stop, kill or restart a broker:
the soak (``outbox bench --soak``) and the fault suite (``tests/fixtures/faults.py``).

The shared broker is never restarted: a node of its own is started from the
installed server (``/usr/lib/rabbitmq/bin``) in a temporary folder, in the
foreground as a child process, with its own Erlang cookie (``HOME``), so that
``rabbitmqctl`` reaches it and nothing else.  The counterpart of
``outbox.db.devcluster`` for PostgreSQL.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid

import pika

from outbox.errors import OutboxError

RABBIT_BIN = "/usr/lib/rabbitmq/bin"

# Ports this process handed out: a node binds its ports seconds after it is given
# them, so a second node started meanwhile must not be given the same ones.
_handed_out: set[int] = set()


def listen_port() -> int:
    """A free port below the ephemeral range, for a server that binds it seconds later.

    A port from binding to 0 is an ephemeral one: during a node's boot any outgoing
    connection on the host may take it as its local port, and the node then dies
    with eaddrinuse (seen about once in twenty cluster starts).
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            ephemeral = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    for _ in range(10_000):
        port = random.randrange(10000, max(ephemeral, 10001))
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise OutboxError("no free port for a private RabbitMQ node")


class RabbitNode:
    """A throw-away RabbitMQ node: ``start``, ``stop`` (graceful), ``kill`` (-9),
    ``restart``, ``ctl`` (rabbitmqctl), ``destroy``."""

    def __init__(self, extra_conf: str = "", prefix: str = "obxnode") -> None:
        """``extra_conf``: more rabbitmq.conf lines (e.g. a TLS listener, heartbeats)."""
        if not os.path.exists(os.path.join(RABBIT_BIN, "rabbitmq-server")):
            raise OutboxError(
                f"no RabbitMQ server found in {RABBIT_BIN}",
                "install the rabbitmq-server package: this starts a broker of its own",
            )
        self.base = tempfile.mkdtemp(prefix="outbox-rmq-")
        self.name = f"{prefix}{uuid.uuid4().hex[:8]}@localhost"
        self.port = listen_port()
        self.dist_port = listen_port()
        for sub in ("mnesia", "log"):
            os.makedirs(os.path.join(self.base, sub))
        open(os.path.join(self.base, "enabled_plugins"), "w").close()
        open(os.path.join(self.base, "rabbitmq-env.conf"), "w").close()
        # RABBITMQ_CONFIG_FILE names the new-style file with or without ".conf".
        with open(os.path.join(self.base, "rabbitmq.conf"), "w") as conf:
            conf.write(f"loopback_users = none\nlisteners.tcp.default = 127.0.0.1:{self.port}\n")
            conf.write(extra_conf)
        self.env = {
            **os.environ,
            "HOME": self.base,  # its own Erlang cookie, shared with rabbitmqctl
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": os.path.join(self.base, "mnesia"),
            "RABBITMQ_LOG_BASE": os.path.join(self.base, "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": os.path.join(self.base, "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": os.path.join(self.base, "rabbitmq"),
            "RABBITMQ_CONF_ENV_FILE": os.path.join(self.base, "rabbitmq-env.conf"),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
        }
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"

    def start(self, timeout: float = 90.0) -> None:
        """Start the node (again: same folder, ports and name) and wait until it
        accepts connections; ``OutboxError`` if it exits or does not in ``timeout``."""
        with open(os.path.join(self.base, "stdout.log"), "ab") as out:
            self.process = subprocess.Popen(
                [os.path.join(RABBIT_BIN, "rabbitmq-server")],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.base,  # where a node that fails to boot writes erl_crash.dump
            )
        deadline = time.monotonic() + timeout
        while not self.accepts_connections():
            if time.monotonic() > deadline:
                raise OutboxError(
                    f"RabbitMQ node {self.name} did not start in {timeout:.0f} s; "
                    f"see {self.base}/log"
                )
            time.sleep(0.2)

    def accepts_connections(self) -> bool:
        """Whether an AMQP connection opens; ``OutboxError`` if the node has exited."""
        if self.process is not None and self.process.poll() is not None:
            raise OutboxError(f"RabbitMQ node {self.name} exited; see {self.base}/log")
        params = pika.URLParameters(self.url)
        params.connection_attempts = 1
        params.socket_timeout = 1
        try:
            pika.BlockingConnection(params).close()
        except pika.exceptions.AMQPError:
            return False
        return True

    def _end(self, sig: signal.Signals, timeout: float) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        self.process = None
        time.sleep(0.5)  # epmd must forget the node name before it is reused

    def stop(self) -> None:
        """A graceful shutdown of the whole node (SIGTERM), waited for."""
        self._end(signal.SIGTERM, 60)

    def kill(self) -> None:
        """kill -9 of the whole node (beam and its helpers)."""
        self._end(signal.SIGKILL, 30)

    def restart(self) -> None:
        """Stop gracefully and start again.  Graceful: a kill -9 soon after the node's
        first stream was declared can lose the stream coordinator on RabbitMQ 3.10
        (rabbitmq/ra#443)."""
        self.stop()
        self.start()

    def ctl(self, *args: str) -> str:
        return subprocess.run(
            [os.path.join(RABBIT_BIN, "rabbitmqctl"), "-n", self.name, *args],
            env=self.env,
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout

    def destroy(self) -> None:
        self.kill()
        shutil.rmtree(self.base, ignore_errors=True)
