"""Relays whose claims start at a low-water mark (``outbox.db.front``), attacked end
to end: three relays killed (-9) at random while writers commit, and meanwhile
applications' transactions that took their ids early stay open in every shape
PostgreSQL allows.  They commit only once the kills have stopped and the three
relays left have claimed far past their ids, so no relay that starts afresh (and
walks from the bottom) can find them for the fronts: the relays' own fronts
must.  Nothing may be lost or left behind, and duplicates stay within the crash
bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from outbox.config import Settings
from outbox.db import batches
from outbox.relay.process import Relay
from tests.fixtures.faults import (
    RelayProcess,
    check_delivery,
    in_flight,
    insert_rows,
    prepared_left,
    rows_left,
    wait_for,
)
from tests.fixtures.servers import Topology

BATCH = 20
RELAYS = 3
KILL_SECONDS = 4
Conn = psycopg.Connection[Any]


def _rows(conn: Conn, exchange: str, count: int, *, key: str | None = None) -> list[str]:
    return [
        str(r[0])
        for r in conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload, ordering_key) "
            "SELECT %s, 'k', convert_to('late' || i::text, 'UTF8'), %s "
            "FROM generate_series(1, %s) i RETURNING message_id",
            [exchange, key, count],
        ).fetchall()
    ]


def test_front__late_transactions_reach_long_running_relays_after_kills(
    settings: Settings, topology: Topology
) -> None:
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    chaos = dataclasses.replace(settings, batch_size=BATCH)
    exchange = topology.exchange
    committed: list[str] = []
    stop_writing = threading.Event()

    def writer() -> None:
        n = 0
        while not stop_writing.is_set():
            n += 1
            committed.extend(insert_rows(chaos.dsn, exchange, rng.randint(1, 30), tag=f"w{n}-"))
            time.sleep(0.02)

    # Open, each with rows inserted now; finish() commits them later.
    late: list[tuple[str, Conn, Callable[[Conn], list[str]]]] = []
    with contextlib.ExitStack() as stack:

        def opened() -> Conn:
            return stack.enter_context(psycopg.connect(chaos.dsn))

        plain = opened()
        plain_rows = _rows(plain, exchange, 3, key="plain")
        late.append(("plain", plain, lambda c: (c.commit(), plain_rows)[1]))

        nested = opened()
        nested_rows: list[str] = []
        for i in range(70):  # more than 64: the snapshots' subxip overflows
            nested.execute(f"SAVEPOINT s{i}")
            nested_rows += _rows(nested, exchange, 1, key="nested")
        late.append(("nested", nested, lambda c: (c.commit(), nested_rows)[1]))

        app_2pc = opened()
        app_rows = _rows(app_2pc, exchange, 4, key="app_2pc")
        app_2pc.execute("PREPARE TRANSACTION 'app_late'")

        def commit_prepared(c: Conn) -> list[str]:
            c.autocommit = True
            c.execute("COMMIT PREPARED 'app_late'")
            return app_rows

        late.append(("app_2pc", app_2pc, commit_prepared))

        bulk = opened()  # more late ids than the front keeps (LATE_MOST)
        bulk_rows = _rows(bulk, exchange, 1_500)
        late.append(("bulk", bulk, lambda c: (c.commit(), bulk_rows)[1]))

        rolled_back = opened()
        _rows(rolled_back, exchange, 5)
        late.append(("rolled_back", rolled_back, lambda c: (c.rollback(), [])[1]))

        multi = opened()
        multi_rows = _rows(multi, exchange, 2, key="multi")

        below = opened()  # an id from elsewhere, below every id of the sequence
        below_rows = [
            str(r[0])
            for r in below.execute(
                "INSERT INTO outbox (id, exchange, routing_key, payload) OVERRIDING SYSTEM VALUE "
                "VALUES (-7, %s, 'k', 'below') RETURNING message_id",
                [exchange],
            ).fetchall()
        ]
        late.append(("below", below, lambda c: (c.commit(), below_rows)[1]))

        relays = [RelayProcess(chaos) for _ in range(RELAYS)]
        stack.callback(lambda: [relay.close() for relay in relays])
        thread = threading.Thread(target=writer)
        thread.start()
        kills = 0
        try:
            deadline = time.monotonic() + KILL_SECONDS
            while time.monotonic() < deadline:
                time.sleep(rng.uniform(0.3, 1.0))
                victim = rng.randrange(RELAYS)
                relays[victim].kill()
                relays[victim].close()
                kills += 1
                relays[victim] = RelayProcess(chaos)
                multi_rows += _rows(multi, exchange, 1, key="multi")  # over time
            late.append(("multi", multi, lambda c: (c.commit(), multi_rows)[1]))
            # No more kills: the relays now running claim past the late ids
            # before any of them commits.
            mark = len(committed)
            wait_for(lambda: len(committed) > mark + 300, 30, "rows written after the kills")
            wait_for(lambda: rows_left(chaos.dsn) < 200 + 1_500 + 90, 30, "the relays to catch up")
            rng.shuffle(late)
            for name, conn, finish in late:
                committed.extend(finish(conn))
                mark = len(committed)
                wait_for(lambda m=mark: len(committed) > m + 30, 30, f"rows after {name}")
        finally:
            stop_writing.set()
            thread.join()
        wait_for(
            lambda: rows_left(chaos.dsn) == 0 and not prepared_left(chaos.dsn),
            30,
            "the running relays to publish every row",
        )
        for relay in relays:
            assert relay.process.poll() is None, relay.output()
    bound = (kills + RELAYS) * in_flight(chaos) * BATCH
    report = check_delivery(chaos.dsn, topology, committed, max_duplicates=bound)
    print(f"{kills} kills, {len(committed)} rows, {report.duplicates} duplicates (bound {bound})")


def test_front__an_idle_relay_finds_a_row_whose_txid_the_application_wrote(
    settings: Settings, topology: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle relay (fallback poll 30 s) whose front has passed a row whose txid the
    application wrote (NULL, committed late) claims from the bottom once its rescan
    is due (here 2 s): the row is published, not left until the relay reconnects."""
    monkeypatch.setattr(batches, "RESCAN_SECONDS", 2.0, raising=False)
    relay = Relay(
        dataclasses.replace(
            settings, poll_interval=30.0, heartbeat_interval=10.0, relay_timeout=60.0
        )
    )
    app = psycopg.connect(settings.dsn)
    thread = threading.Thread(target=relay.run)
    try:
        [(late,)] = app.execute(
            "INSERT INTO outbox (exchange, routing_key, payload, txid) "
            "VALUES (%s, 'k', 'null txid', NULL) RETURNING message_id",
            [topology.exchange],
        ).fetchall()
        relay.start()
        thread.start()
        later = insert_rows(settings.dsn, topology.exchange, 20)
        wait_for(lambda: relay.stats.messages_published == 20, 30, "the later rows")
        assert relay.store is not None
        [(late_id,)] = app.execute("SELECT id FROM outbox").fetchall()
        front = relay.store.front.low_water
        assert front is not None and front > late_id, (front, late_id)
        app.commit()
        wait_for(lambda: relay.stats.messages_published == 21, 15, "the row with a NULL txid")
    finally:
        app.close()
        relay.stop.set()
        if thread.is_alive():
            thread.join(timeout=30)
    check_delivery(settings.dsn, topology, [str(late), *later], max_duplicates=0)
