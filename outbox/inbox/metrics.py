"""Metrics, liveness and readiness of one ``outbox consume`` process.

Counters and the handler-duration histogram are read from the consumer's
``ConsumerStats`` when Prometheus scrapes.  The one database figure (parked
messages of this consumer) comes from a connection of the endpoint's own, cached
for ``DATABASE_CACHE_SECONDS``, never from the consumer's connection.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from outbox import health
from outbox.db.inbox import InboxStore
from outbox.probes import DATABASE_CACHE_SECONDS, Endpoints, Figures, histogram

if TYPE_CHECKING:
    from outbox.inbox.settings import ConsumerSettings


class Inbox(Protocol):
    """What the metrics and endpoints read of an ``outbox.inbox.process.Inbox`` (which
    starts them: a protocol, so that neither module imports the other's)."""

    @property
    def settings(self) -> ConsumerSettings: ...

    @property
    def stats(self) -> Any: ...  # stats.ConsumerStats

    @property
    def broker(self) -> Any: ...  # steps.BrokerPort: .connected

    @property
    def store(self) -> Any: ...  # steps.StorePort or None: .broken

    @property
    def stopping(self) -> bool: ...


class ParkedFigure(Figures[InboxStore, int]):
    """Parked messages of this consumer, cached; ``error`` says why it is unknown."""

    def __init__(self, settings: ConsumerSettings, ttl: float = DATABASE_CACHE_SECONDS) -> None:
        super().__init__(ttl)
        self._settings = settings

    def open(self) -> InboxStore:
        s = self._settings
        return InboxStore(
            s.dsn,
            s.inbox_table,
            s.consumer,
            application_name="outbox-consume-metrics",
            connect_timeout=min(s.connect_timeout, 3.0),
        )

    def read(self, store: InboxStore) -> int:
        return store.parked_count()


class ConsumerCollector(Collector):
    def __init__(self, inbox: Inbox, parked: ParkedFigure) -> None:
        self.inbox = inbox
        self.parked = parked

    def collect(self) -> Iterator[Metric]:
        stats = self.inbox.stats
        for name, value, doc in (
            ("handled", stats.handled, "Messages whose effect this consumer committed."),
            (
                "duplicates_skipped",
                stats.duplicates_skipped,
                "Deliveries whose message id was already in the inbox (acked, no effect).",
            ),
            (
                "handler_failures",
                stats.handler_failures,
                "Handler calls that raised (rolled back; retried or parked).",
            ),
            ("reconnects", stats.reconnects, "Retries after a database or broker failure."),
            (
                "custody_taken",
                stats.custody_taken,
                "Messages stored in <inbox>_custody and acked as they arrived: the broker "
                "had returned them once, and a queue with a delivery limit may drop them.",
            ),
            ("inbox_pruned", stats.pruned, "Inbox ids deleted by retention."),
        ):
            yield CounterMetricFamily(f"outbox_consumer_{name}", doc, value=value)
        parked = CounterMetricFamily(
            "outbox_consumer_parked",
            "Messages this consumer parked (gave up on), by reason: failed (the handler "
            "kept failing), unfinished (the outcome of the last attempt is unknown: the "
            "handler may kill the process), unusable (no message_id, or unreadable "
            "properties).",
            labels=["reason"],
        )
        for reason, count in stats.parked_by.items():  # every reason, 0 included
            parked.add_metric([reason], count)
        yield parked
        yield histogram(
            "outbox_consumer_handler_duration_seconds",
            "Handler calls, successful or not (the transaction's commit not included).",
            stats.handler_seconds,
        )
        yield GaugeMetricFamily(
            "outbox_consumer_custody_messages",
            "Messages of this consumer in <inbox>_custody, waiting to be applied (as the "
            "consume loop last saw them).",
            value=stats.custody_held,
        )
        yield GaugeMetricFamily(
            "outbox_consumer_broker_up",
            "1 if the consumer is subscribed to its queue.",
            value=int(self.inbox.broker.connected),
        )
        self.parked.refresh()
        yield GaugeMetricFamily(
            "outbox_consumer_database_up",
            "1 if the metrics query reached the consumer's PostgreSQL.",
            value=int(self.parked.figures is not None),
        )
        if self.parked.figures is not None:
            yield GaugeMetricFamily(
                "outbox_consumer_parked_messages",
                "Rows of this consumer in <inbox>_parked.",
                value=self.parked.figures,
            )


def liveness_limit(settings: ConsumerSettings) -> float:
    """The longest a healthy pass of the consume loop can take (seconds), plus a margin.

    A pass may wait out a retry delay, back off, reconnect to both servers, or run a
    handler for up to two heartbeats (longer, and the broker drops the connection).
    """
    return (
        settings.retry_delay_max
        + settings.backoff_max
        + 2 * settings.connect_timeout
        + 2 * settings.heartbeat
        + health.LIVENESS_MARGIN
    )


def readiness(
    *, stopping: bool, database_ok: bool, broker_connected: bool, last_error: str | None
) -> health.Check:
    problems = []
    if stopping:
        problems.append("the consumer is stopping")
    if not database_ok:
        problems.append("database: not connected to the consumer's PostgreSQL")
    if not broker_connected:
        problems.append("broker: not subscribed to the queue")
    if last_error is not None:
        problems.append(f"last pass failed: {last_error}")
    return health.Check(not problems, tuple(problems))


class ConsumerEndpoints(Endpoints):
    """``/metrics``, ``/healthz``, ``/readyz`` of an ``Inbox`` (``outbox.probes``)."""

    loop = "the consume loop"

    def __init__(
        self,
        inbox: Inbox,
        *,
        port: int,
        address: str = "0.0.0.0",
        cache_seconds: float = DATABASE_CACHE_SECONDS,
    ) -> None:
        self.inbox = inbox
        self.parked = ParkedFigure(inbox.settings, cache_seconds)
        super().__init__(
            ConsumerCollector(inbox, self.parked),
            self.parked,
            liveness_limit=liveness_limit(inbox.settings),
            port=port,
            address=address,
        )

    def last_progress(self) -> float:
        return float(self.inbox.stats.last_progress)

    def readiness(self) -> health.Check:
        store = self.inbox.store
        return readiness(
            stopping=self.inbox.stopping,
            database_ok=store is not None and not store.broken,
            broker_connected=self.inbox.broker.connected,
            last_error=self.inbox.stats.last_error,
        )
