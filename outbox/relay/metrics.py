"""Prometheus metrics of one relay process, and its HTTP endpoints (``RelayEndpoints``).

Counters and the batch-duration histogram come from the relay's ``Stats`` and are
read when Prometheus scrapes, so the relay's hot path pays nothing for them.
Figures that need the database (backlog, prepared batches, dead letters, live
relays, the outbox's dead rows and the MVCC horizon's age) come from a few queries
on a connection of the metrics endpoint's own, bounded by ``statement_timeout``,
cached for ``DATABASE_CACHE_SECONDS`` so that frequent scrapes and probes cost
one round of queries per period.

Database figures describe the whole table, so every relay exports the same
values: aggregate them with ``max`` in alerts, never ``sum``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from outbox import health
from outbox.db.batches import BatchStore
from outbox.db.horizon import HorizonReader
from outbox.events import emit
from outbox.probes import DATABASE_CACHE_SECONDS, Endpoints, Figures, histogram

if TYPE_CHECKING:
    from outbox.amqp.publisher import Publisher
    from outbox.config import Settings
    from outbox.relay.stats import Stats


class Relay(Protocol):
    """What the metrics and endpoints read of a ``outbox.relay.process.Relay`` (which
    starts them: a protocol, so that neither module imports the other's)."""

    @property
    def settings(self) -> Settings: ...

    @property
    def stats(self) -> Stats: ...

    @property
    def store(self) -> BatchStore | None: ...

    @property
    def stop(self) -> object: ...  # true once stopping

    @property
    def publisher(self) -> Publisher: ...


log = logging.getLogger("outbox.metrics")

# Bound on the metrics endpoint's statements and lock waits (seconds).
METRICS_STATEMENT_TIMEOUT = 5.0


class DatabaseFigures(Figures[HorizonReader, dict[str, Any]]):
    """The cached result of the ``metrics_snapshot`` query, or why it failed."""

    def __init__(
        self, dsn: str, table: str, *, connect_timeout: float, ttl: float = DATABASE_CACHE_SECONDS
    ) -> None:
        super().__init__(ttl)
        self._dsn, self._table = dsn, table
        self._connect_timeout = min(connect_timeout, 3.0)  # probes time out in seconds

    def open(self) -> HorizonReader:
        return HorizonReader(
            self._dsn,
            self._table,
            application_name="outbox-metrics",
            connect_timeout=self._connect_timeout,
            # A scrape answers in seconds, whatever waits on the server.
            statement_timeout=METRICS_STATEMENT_TIMEOUT,
        )

    def read(self, store: HorizonReader) -> dict[str, Any]:
        figures = dict(store.metrics_snapshot())
        # What the backlog cannot count: rows behind the claim front whose txid is
        # not their writer's, found only by the safety net's passes.
        net = store.net
        figures["full_pass_age_seconds"] = _or_nan(net.last_pass_age)
        figures["full_pass_found_rows"] = _or_nan(net.last_pass_found)
        scheduled = store.scheduled_summary()
        figures["scheduled_rows"] = scheduled["scheduled_rows"]
        figures["scheduled_next_due_seconds"] = _or_nan(scheduled["next_due_seconds"])
        figures["scheduled_overdue_seconds"] = scheduled["overdue_seconds"]
        horizon = store.horizon(limit=1)
        figures["dead_rows"] = horizon.dead_rows or 0
        figures["horizon_age_seconds"] = horizon.age_seconds
        figures["horizon_age_xids"] = horizon.age_xids
        return figures

    def failed(self, exc: Exception) -> str:
        # A scrape must answer, whatever the database says.
        emit(log, "metrics.query_failed", logging.WARNING, error=repr(exc))
        return f"metrics query failed: {exc}"


def _or_nan(value: float | None) -> float:
    """A figure not known yet (no full pass of the safety net so far) as NaN."""
    return math.nan if value is None else float(value)


class RelayCollector(Collector):
    def __init__(self, relay: Relay, database: DatabaseFigures) -> None:
        self.relay = relay
        self.database = database

    def collect(self) -> Iterator[Metric]:
        stats = self.relay.stats
        yield CounterMetricFamily(
            "outbox_messages_published",
            "Messages confirmed by the broker in committed batches.",
            value=stats.messages_published,
        )
        batches = CounterMetricFamily(
            "outbox_batches",
            "Batches finished by this relay, by outcome (resolved: dead relays' batches).",
            labels=["outcome"],
        )
        batches.add_metric(["committed"], stats.batches_committed)
        batches.add_metric(["rolled_back"], stats.batches_rolled_back)
        batches.add_metric(["resolved"], stats.batches_resolved)
        yield batches
        yield CounterMetricFamily(
            "outbox_dead_lettered",
            "Rows this relay recorded as dead letters.",
            value=stats.dead_letters,
        )
        yield CounterMetricFamily(
            "outbox_scheduled_moved",
            "Scheduled rows this relay moved into the outbox when they came due.",
            value=stats.scheduled_moved,
        )
        yield CounterMetricFamily(
            "outbox_reconnects",
            "Retries after a database or broker failure (each with backoff).",
            value=stats.reconnects,
        )
        failures = CounterMetricFamily(
            "outbox_write_failures",
            "Failures of each relay write (claim, prepare, dead_letters, ledger, "
            "commit_prepared, rollback_prepared); each is retried with backoff.",
            labels=["write"],
        )
        for write, count in sorted(stats.write_failures.items()):
            failures.add_metric([write], count)
        yield failures
        yield CounterMetricFamily(
            "outbox_duplicates_possible",
            "Messages accepted by the broker in batches that were then rolled back.",
            value=stats.duplicates_possible,
        )
        yield histogram(
            "outbox_batch_duration_seconds",
            "Claim to COMMIT PREPARED of committed batches.",
            stats.batch_seconds,
        )
        yield histogram(
            "outbox_claim_duration_seconds",
            "The claim statement (SELECT ... FOR UPDATE SKIP LOCKED and DELETE), every claim.",
            stats.claim_seconds,
        )
        self.database.refresh()
        figures = self.database.figures
        yield GaugeMetricFamily(
            "outbox_database_up",
            "1 if the metrics query reached PostgreSQL.",
            value=int(figures is not None),
        )
        yield GaugeMetricFamily(
            "outbox_broker_up",
            "1 if the relay is connected to RabbitMQ.",
            value=int(self.relay.publisher.connected),
        )
        if figures is None:
            return
        for name, key, doc in (
            (
                "outbox_backlog_rows",
                "backlog_rows",
                "Rows in the outbox table, counted where the relays' claims look; a row "
                "behind the claim front whose txid is not its writer's is counted once "
                "a full pass of the safety net found it (outbox_full_pass_*).",
            ),
            (
                "outbox_full_pass_age_seconds",
                "full_pass_age_seconds",
                "Seconds since the last full pass of the safety net began (NaN: none yet); "
                "rows the backlog cannot count are at most this old, plus a pass.",
            ),
            (
                "outbox_full_pass_found_rows",
                "full_pass_found_rows",
                "Rows the last full pass of the safety net found behind the claim front "
                "that their txid did not reveal (NaN: no pass yet); 0 in normal operation.",
            ),
            (
                "outbox_backlog_oldest_age_seconds",
                "oldest_row_age_seconds",
                "Age of the oldest row in the outbox table (0 if empty).",
            ),
            (
                "outbox_prepared_batches",
                "prepared_batches",
                "Prepared transactions (batches in flight or in doubt) of this table.",
            ),
            (
                "outbox_prepared_oldest_age_seconds",
                "oldest_prepared_age_seconds",
                "Age of the oldest prepared batch of this table (0 if none).",
            ),
            ("outbox_dead_letters", "dead_letters", "Rows in the dead-letter table."),
            (
                "outbox_scheduled_rows",
                "scheduled_rows",
                "Rows scheduled for later (deliver_at), not yet due or not yet moved.",
            ),
            (
                "outbox_scheduled_next_due_seconds",
                "scheduled_next_due_seconds",
                "Seconds until the next scheduled row is due (NaN: none scheduled).",
            ),
            (
                "outbox_scheduled_overdue_seconds",
                "scheduled_overdue_seconds",
                "How long the oldest due scheduled row has waited to be moved into the "
                "outbox (0: none); a relay moves due rows within a second.",
            ),
            (
                "outbox_dead_letter_ordering_keys",
                "dead_letter_ordering_keys",
                "Ordering keys with a dead letter (held back unless ordering_dead_letters=skip).",
            ),
            ("outbox_live_relays", "live_relays", "Relays whose control session is alive."),
            (
                "outbox_dead_rows",
                "dead_rows",
                "Dead rows in the outbox table (pg_stat_user_tables.n_dead_tup): deleted, "
                "not yet removed by vacuum; they grow while the MVCC horizon is held.",
            ),
            (
                "outbox_horizon_age_seconds",
                "horizon_age_seconds",
                "How long the oldest session or prepared transaction holding the MVCC "
                "horizon has held it (0 if none); `outbox status` names it.",
            ),
            (
                "outbox_horizon_age_xids",
                "horizon_age_xids",
                "Transactions committed since the oldest holder of the MVCC horizon "
                "(sessions, replication slots' xmin, prepared transactions) took it.",
            ),
        ):
            yield GaugeMetricFamily(name, doc, value=float(figures[key]))


class RelayEndpoints(Endpoints):
    """The relay's ``/metrics``, ``/healthz`` and ``/readyz`` (``outbox.probes``).

    It only reads the relay's state; the one database query it makes runs on a
    connection of its own (``DatabaseFigures``), never on the relay's.
    """

    loop = "the relay loop"

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
        super().__init__(
            RelayCollector(relay, self.database),
            self.database,
            liveness_limit=health.liveness_limit(settings),
            port=port,
            address=address,
        )

    def last_progress(self) -> float:
        return self.relay.stats.last_progress

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
