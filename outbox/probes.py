"""What a process serves to its probes and scrapers: ``/metrics``, ``/healthz`` and
``/readyz`` over one small HTTP server, and the histogram both the relay and the
consumer export.

``Endpoints`` is the one implementation for both: the relay's
(``outbox.relay.metrics.RelayEndpoints``) and the consumer's
(``outbox.inbox.metrics.ConsumerEndpoints``) only add their collector, their
readiness check and how long their loop may take; ``outbox.lifecycle`` starts them.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Generic, Protocol, TypeVar

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from outbox import health
from outbox.durations import Durations
from outbox.errors import ExitCode, OutboxError

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


class PortUnavailable(OutboxError):
    """The endpoints cannot listen on the address and port asked for (a usage error)."""

    exit_code = ExitCode.USAGE


_Served = TypeVar("_Served", bound="Endpoints")


class Session(Protocol):
    """A database session of an endpoint's own: ``broken`` once its connection is lost."""

    @property
    def broken(self) -> bool: ...

    def close(self) -> None: ...


S = TypeVar("S", bound=Session)
V = TypeVar("V")


class Figures(abc.ABC, Generic[S, V]):
    """What an endpoint reads from the database (``read``) on a session of its own
    (``open``), at most once per ``ttl`` however often it is scraped or probed:
    ``figures``, or None and ``error`` saying why.  The relay's and the consumer's
    (``outbox.relay.metrics.DatabaseFigures``, ``outbox.inbox.metrics.ParkedFigure``)
    only say what they open and read."""

    def __init__(self, ttl: float = DATABASE_CACHE_SECONDS) -> None:
        self._ttl = ttl
        self._lock = threading.Lock()
        self._store: S | None = None
        self._expires = 0.0
        self.figures: V | None = None
        self.error: str | None = "not read yet"

    @abc.abstractmethod
    def open(self) -> S: ...

    @abc.abstractmethod
    def read(self, store: S) -> V: ...

    def failed(self, exc: Exception) -> str:
        """Why the figures are unknown after ``exc``, an error that is not an
        ``OutboxError``; by default it is raised to the scrape."""
        raise exc

    def refresh(self) -> None:
        """Read the figures unless the last answer is younger than the ttl."""
        with self._lock:
            if time.monotonic() < self._expires:
                return
            try:
                if self._store is None or self._store.broken:
                    self.close()
                    self._store = self.open()
                self.figures, self.error = self.read(self._store), None
            except OutboxError as exc:
                self.figures, self.error = None, exc.message
                self.close()
            except Exception as exc:
                self.figures, self.error = None, self.failed(exc)
                self.close()
            self._expires = time.monotonic() + self._ttl

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


class Closes(Protocol):
    """What an endpoint reads the database with (a ``Figures``, or a fleet's many):
    closed with the endpoints."""

    def close(self) -> None: ...


class Endpoints:
    """``/metrics``, ``/healthz`` and ``/readyz`` of one process, served from a daemon
    thread; ``port=0`` picks a free port (see ``.port``).  A subclass gives the
    process's readiness; liveness is the same for both: the loop went round within
    ``liveness_limit`` seconds (``last_progress``, a ``time.monotonic()``)."""

    loop = "the loop"  # what liveness names

    def __init__(
        self,
        collector: Collector,
        figures: Closes,
        *,
        liveness_limit: float,
        port: int,
        address: str = "0.0.0.0",
    ) -> None:
        self.figures = figures
        self.liveness_limit = liveness_limit
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        ProcessCollector(registry=self.registry)
        try:
            self._server = HealthServer(
                self.registry, self.liveness, self.readiness, port=port, address=address
            )
        except OSError as exc:
            figures.close()
            raise PortUnavailable(
                f"cannot listen on {address}:{port}: {exc.strerror}",
                "choose a free --metrics-port (0 serves no endpoints)",
            ) from exc
        self.address = address
        self.port = self._server.port

    def start(self: _Served) -> _Served:
        self._server.start()
        return self

    def close(self) -> None:
        self._server.close()
        self.figures.close()

    def last_progress(self) -> float:
        raise NotImplementedError

    def liveness(self) -> health.Check:
        return health.liveness(
            seconds_since_progress=time.monotonic() - self.last_progress(),
            limit=self.liveness_limit,
            loop=self.loop,
        )

    def readiness(self) -> health.Check:
        raise NotImplementedError


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
