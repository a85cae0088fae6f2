"""A PostgreSQL primary with a synchronous standby loses its primary mid-drain.

Relays connect with ``host=a,b port=p1,p2 target_session_attrs=read-write``.  The
primary is stopped with ``-m immediate`` (a crash) while batches are prepared and
published, the standby is promoted, and the relays carry on there: prepared
transactions replicated synchronously are finished on the new primary from the
ledger's evidence.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import psycopg
import pytest

from outbox.config import Settings
from outbox.db import migrate
from outbox.db.devcluster import PostgresCluster
from outbox.ops import status
from tests.fixtures import replication
from tests.fixtures.faults import RelayProcess, check_delivery, prepared_left, rows_left, wait_for
from tests.fixtures.servers import Topology

ROWS = 20_000
RELAYS = 2


@pytest.fixture
def synchronous_pair() -> Iterator[tuple[PostgresCluster, PostgresCluster]]:
    primary = replication.primary()
    standby = None
    try:
        with psycopg.connect(primary.dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE app")
        standby = replication.standby_of(primary, "standby1")
        replication.make_synchronous(primary, "standby1")
        yield primary, standby
    finally:
        if standby is not None:
            standby.destroy()
        primary.destroy()


def _app_dsn(*clusters: PostgresCluster) -> str:
    hosts = ",".join("127.0.0.1" for _ in clusters)
    ports = ",".join(str(c.port) for c in clusters)
    return (
        f"host={hosts} port={ports} dbname=app user=postgres "
        "target_session_attrs=read-write connect_timeout=2"
    )


@pytest.mark.slow
def test_failover__primary_crash_and_promotion_lose_nothing_and_duplicate_nothing(
    synchronous_pair: tuple[PostgresCluster, PostgresCluster],
    settings: Settings,
    topology: Topology,
) -> None:
    primary, standby = synchronous_pair
    dsn = _app_dsn(primary, standby)
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate.migrate(conn, "outbox")  # type: ignore[arg-type]
        committed = [
            str(r[0])
            for r in conn.execute(
                "INSERT INTO outbox (exchange, routing_key, payload) "
                "SELECT %s, 'k', convert_to(i::text, 'UTF8') FROM generate_series(1, %s) i "
                "RETURNING message_id",
                [topology.exchange, ROWS],
            ).fetchall()
        ]
    cluster = dataclasses.replace(settings, dsn=dsn, batch_size=200)
    relays = [RelayProcess(cluster) for _ in range(RELAYS)]
    try:
        wait_for(lambda: rows_left(dsn) < ROWS * 3 // 4, 60, "the drain to be under way")
        primary.stop("immediate")
        crashed = time.monotonic()
        replication.promote(standby)
        promoted = time.monotonic()
        wait_for(
            lambda: rows_left(dsn) == 0 and prepared_left(dsn) == [], 90, "the drain to finish"
        )
        print(
            f"promoted {promoted - crashed:.1f} s after the crash, drained "
            f"{time.monotonic() - promoted:.1f} s after the promotion"
        )
    finally:
        for relay in relays:
            relay.close()
    # Each relay has up to two batches in flight when the primary dies; both relays
    # keep their process, take their relay ids back on the new primary and finish
    # their own batches (``outbox.relay.batches``, the hand-over): none is rolled
    # back, so none is published twice.
    report = check_delivery(dsn, topology, committed, max_duplicates=0)
    print(f"{report.duplicates} duplicates")


def test_status__warns_when_standbys_are_all_asynchronous(
    settings: Settings, topology: Topology
) -> None:
    primary = replication.primary()
    standby = None
    try:
        with psycopg.connect(primary.dsn, autocommit=True) as conn:
            migrate.migrate(conn, "outbox")  # type: ignore[arg-type]
        alone = status.collect(dataclasses.replace(settings, dsn=primary.dsn), max_prepared_age=60)
        assert alone["warnings"] == []
        standby = replication.standby_of(primary, "standby1")
        replication.wait_streaming(primary, "standby1", "async")
        report = status.collect(dataclasses.replace(settings, dsn=primary.dsn), max_prepared_age=60)
        [text] = report["warnings"]
        assert "none synchronous" in text
        assert report["attention"] == []  # a warning, not a failure
        rendered = status.render(report)
        assert "warning: the database streams to 1 standby(s), none synchronous" in rendered
        replication.make_synchronous(primary, "standby1")
        synced = status.collect(dataclasses.replace(settings, dsn=primary.dsn), max_prepared_age=60)
        assert synced["warnings"] == []
    finally:
        if standby is not None:
            standby.destroy()
        primary.destroy()
