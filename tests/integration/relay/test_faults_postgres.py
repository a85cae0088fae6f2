"""PostgreSQL crashes, restarts and exhausted prepared-transaction slots.

These tests stop and crash the server, so they run on a private cluster of their
own (three prepared-transaction slots, so that exhausting them is cheap).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from outbox.config import Settings
from outbox.db import migrate
from outbox.db.batches import BatchStore
from outbox.db.devcluster import PostgresCluster
from outbox.gid import Gid, new_relay_id
from outbox.relay.process import Relay
from tests.fixtures.faults import (
    RelayProcess,
    both_modes,
    check_delivery,
    in_flight,
    insert_rows,
    prepared_left,
    relay_sessions,
    wait_for,
)
from tests.fixtures.servers import Topology

SLOTS = 3
BATCH = 10


@pytest.fixture(scope="module")
def cluster() -> Iterator[PostgresCluster]:
    pg = PostgresCluster(durable=False, max_prepared_transactions=SLOTS)
    pg.start()
    yield pg
    pg.destroy()


def _database(cluster: PostgresCluster, schema: bool) -> str:
    name = f"c_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = psycopg.conninfo.make_conninfo(cluster.dsn, dbname=name)
    if schema:
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate.migrate(conn, "outbox")  # type: ignore[arg-type]
    return dsn


@pytest.fixture
def crash_settings(cluster: PostgresCluster, settings: Settings) -> Iterator[Settings]:
    dsn = _database(cluster, schema=True)
    yield dataclasses.replace(settings, dsn=dsn, batch_size=BATCH)
    # The cluster has three slots: a failed test must not leave them to the next.
    with psycopg.connect(dsn, autocommit=True) as conn:
        for gid in prepared_left(dsn):
            conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))


def run_in_thread(relay: Relay) -> threading.Thread:
    relay.start()
    thread = threading.Thread(target=relay.run)
    thread.start()
    return thread


def stop(relay: Relay, thread: threading.Thread) -> None:
    relay.stop.set()
    thread.join(timeout=60)
    assert not thread.is_alive()


# Not in the fleet subset (-m fleet_faults): this cluster has 3 prepared slots, and
# slots are the cluster's: a fleet's other database holds some at the crash.
# tests/integration/fleet/test_fleet_faults.py crashes PostgreSQL under a fleet.
@both_modes
def test_pg_crash__prepared_batches_survive_and_are_resolved(
    cluster: PostgresCluster, crash_settings: Settings, topology: Topology
) -> None:
    committed = insert_rows(crash_settings.dsn, topology.exchange, 25)
    relay = RelayProcess(crash_settings, crash_at="after_ledger")
    assert relay.wait() < 0, relay.output()
    relay.close()
    # Left: batch 1 with evidence; pipelined, also batch 2, published without any.
    left = in_flight(crash_settings)
    # Another batch as a relay killed right after PREPARE leaves it.
    store = BatchStore(crash_settings.dsn, "outbox")
    assert len(store.claim_batch(BATCH)) == min(BATCH, 25 - left * BATCH)
    store.prepare(str(Gid("outbox", new_relay_id(), 1)))
    store.close()
    in_doubt = prepared_left(crash_settings.dsn)
    assert len(in_doubt) == left + 1

    cluster.stop("immediate")
    cluster.start()

    assert sorted(prepared_left(crash_settings.dsn)) == sorted(in_doubt)
    wait_for(lambda: relay_sessions(crash_settings.dsn) == 0, 10, "no relay sessions")
    relay = RelayProcess(crash_settings, drain=True)
    assert relay.wait() == 0, relay.output()
    relay.close()
    # No evidence: rolled back; evidence: committed.  Only a batch published without
    # evidence (pipelined: batch 2, sent but not confirmed at the crash) may arrive
    # twice, as far as the broker had it.
    check_delivery(crash_settings.dsn, topology, committed, max_duplicates=(left - 1) * BATCH)


@both_modes
@pytest.mark.parametrize("mode", ["immediate", "fast"])
def test_pg_restart__running_relay_reconnects_and_carries_on(
    mode: str, cluster: PostgresCluster, crash_settings: Settings, topology: Topology
) -> None:
    committed = insert_rows(crash_settings.dsn, topology.exchange, 3000)
    relay = Relay(crash_settings)
    thread = run_in_thread(relay)
    try:
        wait_for(lambda: relay.stats.messages_published > 0, 30, "publishing to start")
        cluster.stop(mode)  # mid-stream: a batch is most likely in flight
        cluster.start()
        committed += insert_rows(crash_settings.dsn, topology.exchange, 50, tag="after")
        wait_for(lambda: relay.stats.messages_published >= len(committed), 60, "the backlog")
        assert thread.is_alive(), "the relay must never exit on an outage"
        assert relay.stats.reconnects >= 1
    finally:
        stop(relay, thread)
    wait_for(lambda: not prepared_left(crash_settings.dsn), 30, "dead relay ids' batches")
    # The relay takes its relay id back after the restart and finishes the batches
    # it published (``batches.py``, "the hand-over"): none is rolled back.
    check_delivery(crash_settings.dsn, topology, committed, max_duplicates=0)


@both_modes
def test_prepared_slots_exhausted__relay_backs_off_says_so_and_resumes(
    cluster: PostgresCluster,
    crash_settings: Settings,
    topology: Topology,
    caplog: pytest.LogCaptureFixture,
) -> None:
    other_app = _database(cluster, schema=False)
    gids = [f"other-app:{i}" for i in range(SLOTS)]
    with psycopg.connect(other_app, autocommit=True) as conn:
        for gid in gids:
            conn.execute("BEGIN")
            conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
    committed = insert_rows(crash_settings.dsn, topology.exchange, 5)
    caplog.set_level(logging.WARNING, logger="outbox")
    relay = Relay(crash_settings)
    thread = run_in_thread(relay)
    try:

        def exhausted() -> int:
            return sum("relay.prepared_slots_exhausted" in r.message for r in caplog.records)

        wait_for(lambda: exhausted() >= 3, 30, "the relay to report exhausted slots")
        assert relay.stats.messages_published == 0
        attempts_before = exhausted()
        with psycopg.connect(other_app, autocommit=True) as conn:
            for gid in gids:
                conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
        wait_for(lambda: relay.stats.messages_published == 5, 30, "the rows after slots freed")
        assert thread.is_alive()
    finally:
        stop(relay, thread)
    hint = next(r.message for r in caplog.records if "prepared_slots_exhausted" in r.message)
    assert "max_prepared_transactions" in hint
    # Backing off (0.05 s doubling to 0.5 s here), not spinning: a handful of tries.
    assert attempts_before < 50
    check_delivery(crash_settings.dsn, topology, committed, max_duplicates=0)


@both_modes
def test_pg_restart__surviving_relay_finishes_its_batches_three_times_no_duplicate(
    cluster: PostgresCluster, settings: Settings, topology: Topology
) -> None:
    # Batches of 200, so that each crash finds one (or, pipelined, two) published and
    # waiting for its evidence: the relay, alive all along, finishes them after
    # reconnecting under its own relay id instead of leaving them to a rollback.
    restart_settings = dataclasses.replace(
        settings, dsn=_database(cluster, schema=True), batch_size=200
    )
    committed = insert_rows(restart_settings.dsn, topology.exchange, 6000)
    relay = Relay(restart_settings)
    thread = run_in_thread(relay)
    try:
        for crash in range(1, 4):
            wait_for(
                lambda c=crash: relay.stats.messages_published >= c * 1200,  # type: ignore[misc]
                60,
                f"publishing before crash {crash}",
            )
            cluster.stop("immediate")
            cluster.start()
        wait_for(lambda: relay.stats.messages_published >= len(committed), 60, "the backlog")
        assert relay.stats.reconnects >= 3
    finally:
        stop(relay, thread)
    wait_for(lambda: not prepared_left(restart_settings.dsn), 30, "every batch finished")
    report = check_delivery(restart_settings.dsn, topology, committed, max_duplicates=0)
    assert relay.stats.duplicates_possible == 0
    print(f"{report.duplicates} duplicates, {relay.stats.reconnects} reconnects")
