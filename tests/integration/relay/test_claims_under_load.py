"""Claims under realistic load: slow statements, killed clients, bursty writers.

No fault is injected in these tests but a slow or killed statement, so they assert
exact counts: every row exactly once, no batch rolled back, no relay presumed dead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from outbox.config import Settings
from outbox.db.batches import BatchStore
from outbox.relay.process import Relay, StopFlag
from resolver.apply import resolve
from tests.fixtures.faults import (
    RelayProcess,
    both_modes,
    check_delivery,
    drain,
    insert_rows,
    prepared_left,
    rows_left,
    wait_for,
)
from tests.fixtures.servers import Topology


def _install_slow_claim(dsn: str, seconds: float, *, times: int = 1) -> None:
    """Deleting the row whose payload is ``slow`` sleeps ``seconds``, the first
    ``times`` times only (a sequence counts: it is not rolled back with the claim)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE SEQUENCE slow_claims")
        conn.execute(
            f"""
            CREATE FUNCTION slow_claim() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF OLD.payload = 'slow'::bytea AND nextval('slow_claims') <= {times} THEN
                    PERFORM pg_sleep({seconds});
                END IF;
                RETURN OLD;
            END $$
            """
        )
        conn.execute(
            "CREATE TRIGGER slow_claim BEFORE DELETE ON outbox "
            "FOR EACH ROW EXECUTE FUNCTION slow_claim()"
        )


def _insert_around_slow_row(dsn: str, exchange: str, before: int, after: int) -> list[str]:
    """One transaction: ``before`` rows, the slow row, ``after`` rows (in id order)."""
    insert = (
        "INSERT INTO outbox (exchange, routing_key, payload) "
        "SELECT %s, 'k', convert_to(%s || i::text, 'UTF8') FROM generate_series(1, %s) i "
        "RETURNING message_id"
    )
    with psycopg.connect(dsn) as conn:
        ids = [r[0] for r in conn.execute(insert, [exchange, "a", before]).fetchall()]
        ids += [
            r[0]
            for r in conn.execute(
                "INSERT INTO outbox (exchange, routing_key, payload) "
                "VALUES (%s, 'k', 'slow'::bytea) RETURNING message_id",
                [exchange],
            ).fetchall()
        ]
        ids += [r[0] for r in conn.execute(insert, [exchange, "b", after]).fetchall()]
    return [str(i) for i in ids]


@contextlib.contextmanager
def running_relays(settings: Settings, count: int) -> Iterator[list[Relay]]:
    """``count`` relays running in threads, stopped (batch in flight finished) on exit."""
    relays = [Relay(settings, stop=StopFlag()) for _ in range(count)]
    for relay in relays:
        relay.start()
    threads = [threading.Thread(target=r.run, daemon=True) for r in relays]
    for thread in threads:
        thread.start()
    try:
        yield relays
    finally:
        for relay in relays:
            relay.stop.set()
        for thread in threads:
            thread.join(timeout=60)


def _drained(dsn: str) -> bool:
    return rows_left(dsn) == 0 and prepared_left(dsn) == []


@both_modes
def test_liveness__claim_slower_than_relay_timeout_costs_nothing(
    settings: Settings, topology: Topology
) -> None:
    """A claim slower than --relay-timeout while a batch is prepared (pipelined: and
    published) and resolvers keep running: no rollback, no session ended, 0 duplicates."""
    slow = dataclasses.replace(settings, batch_size=10, statement_timeout=60.0)
    _install_slow_claim(slow.dsn, slow.relay_timeout + 2)
    committed = _insert_around_slow_row(slow.dsn, topology.exchange, before=10, after=19)

    finished_by_resolvers: list[str] = []
    stop_resolving = threading.Event()

    def other_relays_resolving() -> None:  # what every other relay's periodic pass does
        store = BatchStore(slow.dsn, slow.table)
        try:
            while not stop_resolving.wait(0.3):
                finished_by_resolvers.extend(r.gid for r in resolve(store, slow) if r.finished)
        finally:
            store.close()

    resolver = threading.Thread(target=other_relays_resolving, daemon=True)
    resolver.start()
    try:
        with running_relays(slow, 1) as [relay]:
            relay_id = relay.relay_id
            wait_for(lambda: _drained(slow.dsn), 60, "the outbox to drain")
    finally:
        stop_resolving.set()
        resolver.join(timeout=30)

    assert relay.stats.slowest_claim >= slow.relay_timeout
    assert finished_by_resolvers == [], "a resolver finished a live relay's batch"
    assert relay.relay_id == relay_id, "the relay lost its control session"
    assert relay.stats.batches_rolled_back == 0
    assert relay.stats.duplicates_possible == 0
    check_delivery(slow.dsn, topology, committed, max_duplicates=0)


def test_statement_timeout__cancelled_claim_is_logged_and_retried(
    settings: Settings, topology: Topology, caplog: pytest.LogCaptureFixture
) -> None:
    bounded = dataclasses.replace(settings, statement_timeout=1.0)
    _install_slow_claim(bounded.dsn, 5)
    committed = _insert_around_slow_row(bounded.dsn, topology.exchange, before=5, after=5)

    with caplog.at_level(logging.WARNING, logger="outbox"), running_relays(bounded, 1) as [relay]:
        wait_for(lambda: _drained(bounded.dsn), 30, "the outbox to drain")

    retries = [r.getMessage() for r in caplog.records if "relay.retry" in r.getMessage()]
    assert any("cancelled the statement claiming a batch after 1 s" in m for m in retries), retries
    assert relay.stats.reconnects >= 1
    check_delivery(bounded.dsn, topology, committed, max_duplicates=0)


def _claim_backend(dsn: str) -> int | None:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = 'outbox-relay' AND wait_event = 'PgSleep'"
        ).fetchone()
    return int(row[0]) if row else None


def _backend_alive(dsn: str, pid: int) -> bool:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()
    return bool(row and row[0])


def test_killed_relay__its_claim_stops_on_the_server(
    settings: Settings, topology: Topology
) -> None:
    """kill -9 during a long claim: the backend notices the missing client within
    seconds (client_connection_check_interval), not when the statement ends."""
    long_bound = dataclasses.replace(settings, statement_timeout=300.0)
    _install_slow_claim(long_bound.dsn, 120)
    committed = _insert_around_slow_row(long_bound.dsn, topology.exchange, before=3, after=3)

    relay = RelayProcess(long_bound)
    try:
        pid = wait_for(lambda: _claim_backend(long_bound.dsn), 30, "the slow claim to start")
        relay.kill()
        killed = time.monotonic()
        wait_for(lambda: not _backend_alive(long_bound.dsn, pid), 20, "the orphan claim to stop")
        assert time.monotonic() - killed < 10
    finally:
        relay.close()

    with psycopg.connect(long_bound.dsn, autocommit=True) as conn:
        conn.execute("DROP TRIGGER slow_claim ON outbox")
    drain(long_bound)
    check_delivery(long_bound.dsn, topology, committed, max_duplicates=0)


def test_bursty_writers__several_relays_exactly_once(
    settings: Settings, topology: Topology
) -> None:
    """3 relays, 4 writers committing bursts while the table is analyzed between them
    (as autovacuum does): every row exactly once, no rollback, batches ≤ batch_size."""
    load = dataclasses.replace(settings, batch_size=100)
    rng = random.Random(8)
    committed: list[str] = []
    lock = threading.Lock()
    writing = threading.Event()
    writing.set()

    def writer(n: int) -> None:
        for burst in range(6):
            ids = insert_rows(load.dsn, topology.exchange, 150, tag=f"w{n}b{burst}-")
            with lock:
                committed.extend(ids)
            time.sleep(rng.uniform(0.1, 0.4))

    def analyzer() -> None:
        with psycopg.connect(load.dsn, autocommit=True) as conn:
            while writing.is_set():
                conn.execute("ANALYZE outbox")
                time.sleep(0.2)

    with running_relays(load, 3) as relays:
        relay_ids = [r.relay_id for r in relays]
        background = threading.Thread(target=analyzer, daemon=True)
        background.start()
        writers = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
        for thread in writers:
            thread.start()
        for thread in writers:
            thread.join()
        last_commit = time.monotonic()
        writing.clear()
        background.join()
        wait_for(lambda: _drained(load.dsn), 60, "the outbox to drain")
        print(f"empty {time.monotonic() - last_commit:.2f} s after the last commit")

    assert [r.relay_id for r in relays] == relay_ids, "a relay lost its control session"
    for relay in relays:
        assert relay.stats.batches_rolled_back == 0
        assert relay.stats.largest_claim <= load.batch_size
    assert sum(r.stats.messages_published for r in relays) == len(committed) == 3600
    check_delivery(load.dsn, topology, committed, max_duplicates=0)
