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

import dataclasses
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from outbox import health, urls
from outbox.db.batches import BatchStore
from outbox.db.horizon import HorizonReader
from outbox.durations import Durations
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

    @property
    def dormant(self) -> bool: ...  # sleeping on its wake-up session alone


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


def database_label(dsn: str) -> str:
    """The ``database`` label of a single relay: the name of the database its DSN
    reaches (a fleet's targets are named by ``outbox.fleet.targets``)."""
    try:
        return urls.dsn_database(urls.check_dsn(dsn))
    except urls.InvalidUrl:
        return ""


@dataclasses.dataclass(frozen=True)
class Member:
    """One relay whose metrics a collector exports, under ``database``."""

    database: str
    relay: Relay
    figures: DatabaseFigures


COUNTERS = (
    (
        "outbox_messages_published",
        "Messages confirmed by the broker in committed batches.",
        "messages_published",
    ),
    ("outbox_dead_lettered", "Rows this relay recorded as dead letters.", "dead_letters"),
    (
        "outbox_scheduled_moved",
        "Scheduled rows this relay moved into the outbox when they came due.",
        "scheduled_moved",
    ),
    (
        "outbox_reconnects",
        "Retries after a database or broker failure (each with backoff).",
        "reconnects",
    ),
    (
        "outbox_duplicates_possible",
        "Messages accepted by the broker in batches that were then rolled back.",
        "duplicates_possible",
    ),
)

GAUGES = (
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
)


def labelled_histogram(
    name: str, documentation: str, series: Sequence[tuple[str, Durations]]
) -> HistogramMetricFamily:
    """``probes.histogram`` with a ``database`` label: one series per relay."""
    family = HistogramMetricFamily(name, documentation, labels=["database"])
    for database, durations in series:
        one = histogram(name, documentation, durations)
        buckets = [(s.labels["le"], s.value) for s in one.samples if s.name.endswith("_bucket")]
        total = next(s.value for s in one.samples if s.name.endswith("_sum"))
        family.add_metric([database], buckets, total)
    return family


class RelayCollector(Collector):
    """The metrics of one relay (``relay``, ``database``), or of a fleet's (``members``
    gives them when scraped), each sample labelled with its ``database``."""

    def __init__(
        self,
        relay: Relay | None = None,
        database: DatabaseFigures | None = None,
        *,
        database_name: str | None = None,
        members: Callable[[], Sequence[Member]] | None = None,
    ) -> None:
        if members is None:
            assert relay is not None and database is not None
            name = database_label(relay.settings.dsn) if database_name is None else database_name
            one = [Member(name, relay, database)]
            members = lambda: one  # noqa: E731
        self.members = members

    def collect(self) -> Iterator[Metric]:
        members = self.members()
        for name, doc, field in COUNTERS[:1]:
            yield self._counter(members, name, doc, field)
        batches = CounterMetricFamily(
            "outbox_batches",
            "Batches finished by this relay, by outcome (resolved: dead relays' batches).",
            labels=["database", "outcome"],
        )
        for m in members:
            batches.add_metric([m.database, "committed"], m.relay.stats.batches_committed)
            batches.add_metric([m.database, "rolled_back"], m.relay.stats.batches_rolled_back)
            batches.add_metric([m.database, "resolved"], m.relay.stats.batches_resolved)
        yield batches
        for name, doc, field in COUNTERS[1:4]:
            yield self._counter(members, name, doc, field)
        failures = CounterMetricFamily(
            "outbox_write_failures",
            "Failures of each relay write (claim, prepare, dead_letters, ledger, "
            "commit_prepared, rollback_prepared); each is retried with backoff.",
            labels=["database", "write"],
        )
        for m in members:
            for write, count in sorted(m.relay.stats.write_failures.items()):
                failures.add_metric([m.database, write], count)
        yield failures
        for name, doc, field in COUNTERS[4:]:
            yield self._counter(members, name, doc, field)
        yield labelled_histogram(
            "outbox_batch_duration_seconds",
            "Claim to COMMIT PREPARED of committed batches.",
            [(m.database, m.relay.stats.batch_seconds) for m in members],
        )
        yield labelled_histogram(
            "outbox_claim_duration_seconds",
            "The claim statement (SELECT ... FOR UPDATE SKIP LOCKED and DELETE), every claim.",
            [(m.database, m.relay.stats.claim_seconds) for m in members],
        )
        read = []
        for m in members:
            m.figures.refresh()
            read.append((m, m.figures.figures))
        up = GaugeMetricFamily(
            "outbox_database_up", "1 if the metrics query reached PostgreSQL.", labels=["database"]
        )
        broker = GaugeMetricFamily(
            "outbox_broker_up", "1 if the relay is connected to RabbitMQ.", labels=["database"]
        )
        for m, figures in read:
            up.add_metric([m.database], int(figures is not None))
            broker.add_metric([m.database], int(m.relay.publisher.connected))
        yield up
        yield broker
        if all(figures is None for _, figures in read):
            return
        for name, key, doc in GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=["database"])
            for m, figures in read:
                if figures is not None:
                    gauge.add_metric([m.database], float(figures[key]))
            yield gauge

    @staticmethod
    def _counter(members: Sequence[Member], name: str, doc: str, field: str) -> Metric:
        family = CounterMetricFamily(name, doc, labels=["database"])
        for m in members:
            family.add_metric([m.database], getattr(m.relay.stats, field))
        return family


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
            started=relay.store is not None or relay.dormant,
            stopping=bool(relay.stop),
            broker_connected=relay.publisher.connected,
            last_error=relay.stats.last_error,
            database_error=self.database.error,
        )
