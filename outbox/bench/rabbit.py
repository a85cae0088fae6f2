"""A private RabbitMQ node for the soak (``outbox bench --soak``), which restarts it.

The shared broker is never restarted: the soak starts a node of its own from the
installed server (``/usr/lib/rabbitmq/bin``) on free ports, in a temporary folder,
in the foreground as a child process, as the fault suite's ``RabbitNode`` does
(``tests/fixtures/faults.py``).  A restart is graceful (SIGTERM, then the same
folder and ports again): a kill -9 soon after the node's first stream was declared
can lose the stream coordinator on RabbitMQ 3.10 (rabbitmq/ra#443), which would
measure that bug, not the relay.
"""

from __future__ import annotations

import contextlib
import os
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


def listen_port() -> int:
    """A free port below the ephemeral range: an ephemeral one may be taken by any
    outgoing connection during the node's boot (the node then dies with eaddrinuse)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            ephemeral = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    for _ in range(1000):
        port = 10000 + int.from_bytes(os.urandom(2), "big") % max(1, ephemeral - 10000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise OutboxError("no free port for a private RabbitMQ node")


class PrivateRabbit:
    """A throw-away RabbitMQ node; ``start``, ``restart``, ``destroy``."""

    def __init__(self) -> None:
        if not os.path.exists(os.path.join(RABBIT_BIN, "rabbitmq-server")):
            raise OutboxError(
                "no RabbitMQ server found in /usr/lib/rabbitmq/bin",
                "install the rabbitmq-server package: the soak restarts a broker of its own",
            )
        self.base = tempfile.mkdtemp(prefix="outbox-bench-rmq-")
        self.name = f"obxsoak{uuid.uuid4().hex[:8]}@localhost"
        self.port = listen_port()
        for sub in ("mnesia", "log"):
            os.makedirs(os.path.join(self.base, sub))
        open(os.path.join(self.base, "enabled_plugins"), "w").close()
        open(os.path.join(self.base, "rabbitmq-env.conf"), "w").close()
        with open(os.path.join(self.base, "rabbitmq.conf"), "w") as conf:
            conf.write(f"loopback_users = none\nlisteners.tcp.default = 127.0.0.1:{self.port}\n")
        self.env = {
            **os.environ,
            "HOME": self.base,
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_DIST_PORT": str(listen_port()),
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
        with open(os.path.join(self.base, "stdout.log"), "ab") as out:
            self.process = subprocess.Popen(
                [os.path.join(RABBIT_BIN, "rabbitmq-server")],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.base,
            )
        deadline = time.monotonic() + timeout
        while not self.accepts_connections():
            if self.process.poll() is not None:
                raise OutboxError(f"the private RabbitMQ node exited; see {self.base}/log")
            if time.monotonic() > deadline:
                raise OutboxError(f"the private RabbitMQ node did not start in {timeout:.0f} s")
            time.sleep(0.2)

    def accepts_connections(self) -> bool:
        params = pika.URLParameters(self.url)
        params.connection_attempts = 1
        params.socket_timeout = 1
        try:
            pika.BlockingConnection(params).close()
        except pika.exceptions.AMQPError:
            return False
        return True

    def stop(self) -> None:
        """A graceful shutdown of the whole node (SIGTERM), waited for."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        self.process = None
        time.sleep(0.5)  # epmd must forget the node name before it is reused

    def restart(self) -> None:
        self.stop()
        self.start()

    def destroy(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
            self.process = None
        shutil.rmtree(self.base, ignore_errors=True)
