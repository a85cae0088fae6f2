"""One small HTTP server per process: ``/metrics``, ``/healthz`` and ``/readyz``.

It runs in a daemon thread next to the relay loop and only reads the relay's
state; the one database query it makes runs on a connection of its own
(``metrics.DatabaseFigures``), never on the relay's.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from outbox import health
from outbox.probes import (
    DATABASE_CACHE_SECONDS,
    HealthServer,
)
from outbox.relay.metrics import DatabaseFigures, registry_for

if TYPE_CHECKING:
    from outbox.relay.process import Relay


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
