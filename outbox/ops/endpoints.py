"""One small HTTP server per process: ``/metrics``, ``/healthz`` and ``/readyz``.

It runs in a daemon thread next to the relay loop and only reads the relay's
state; the one database query it makes runs on a connection of its own
(``metrics.DatabaseFigures``), never on the relay's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from outbox import health
from outbox.relay.metrics import DATABASE_CACHE_SECONDS, DatabaseFigures, registry_for

if TYPE_CHECKING:
    from outbox.relay.process import Relay

METRICS_PATH = "/metrics"
LIVENESS_PATH = "/healthz"
READINESS_PATH = "/readyz"


class HealthServer:
    """``/metrics`` from a registry, ``/healthz`` and ``/readyz`` from two checks, in a
    daemon thread; ``port=0`` picks a free port (see ``.port``).  The relay and
    ``outbox consume`` each serve one."""

    def __init__(
        self,
        registry: CollectorRegistry,
        liveness: Callable[[], health.Check],
        readiness: Callable[[], health.Check],
        *,
        port: int,
        address: str = "0.0.0.0",
    ) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == METRICS_PATH:
                    self._answer(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path in (LIVENESS_PATH, READINESS_PATH):
                    check = liveness() if path == LIVENESS_PATH else readiness()
                    self._answer(200 if check.ok else 503, check.body().encode())
                else:
                    self._answer(404, b"not found\n")

            def _answer(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # probes every few seconds would drown the process's own events

        self._server = ThreadingHTTPServer((address, port), Handler)
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="outbox-endpoints", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class Endpoints:
    """The relay's HTTP endpoints; ``port=0`` picks a free port (see ``.port``)."""

    def __init__(
        self,
        relay: Relay,
        *,
        port: int,
        address: str = "0.0.0.0",
        cache_seconds: float = DATABASE_CACHE_SECONDS,
    ) -> None:
        self.relay = relay
        settings = relay.settings
        self.database = DatabaseFigures(
            settings.dsn,
            settings.table,
            connect_timeout=settings.connect_timeout,
            ttl=cache_seconds,
        )
        self.registry = registry_for(relay, self.database)
        self.liveness_limit = health.liveness_limit(settings)
        self._server = HealthServer(
            self.registry, self.liveness, self.readiness, port=port, address=address
        )
        self.port = self._server.port

    def start(self) -> Endpoints:
        self._server.start()
        return self

    def close(self) -> None:
        self._server.close()
        self.database.close()

    def liveness(self) -> health.Check:
        return health.liveness(
            seconds_since_progress=time.monotonic() - self.relay.stats.last_progress,
            limit=self.liveness_limit,
        )

    def readiness(self) -> health.Check:
        self.database.refresh()
        relay = self.relay
        return health.readiness(
            started=relay.store is not None,
            stopping=bool(relay.stop),
            broker_connected=relay.publisher.connected,
            last_error=relay.stats.last_error,
            database_error=self.database.error,
        )
