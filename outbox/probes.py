"""What a process serves to its probes and scrapers: ``/metrics``, ``/healthz`` and
``/readyz`` over one small HTTP server, and the histogram both the relay and the
consumer export.  The relay (``outbox.ops.endpoints``) and ``outbox consume``
(``outbox.inbox.metrics``) each run one ``HealthServer``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import HistogramMetricFamily

from outbox import health
from outbox.durations import Durations

# Database figures in /metrics are at most this old: a scrape every few seconds
# must not become a query every few seconds.
DATABASE_CACHE_SECONDS = 5.0

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


def histogram(name: str, documentation: str, durations: Durations) -> HistogramMetricFamily:
    """A Prometheus histogram of a ``Durations`` (relay and consumer alike)."""
    snapshot = durations.snapshot()
    return HistogramMetricFamily(
        name,
        documentation,
        buckets=[
            ("+Inf" if bound == float("inf") else repr(bound), count)
            for bound, count in snapshot.buckets
        ],
        sum_value=snapshot.total,
    )
