"""Messages at a time (schema 0009): a row written with ``deliver_at`` or ``delay``
waits in the scheduled table until due, then the relay's mover puts it in the
outbox (``outbox/db/scheduled.py``); ``outbox.cancel`` takes it back until then."""

from __future__ import annotations

import dataclasses
import datetime
import threading
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest

import outbox
from outbox.config import Settings
from outbox.relay.process import Relay
from tests.fixtures.faults import RelayProcess, arrived, check_delivery, rows_left, wait_for
from tests.fixtures.servers import Topology


@pytest.fixture
def relay(settings: Settings) -> Iterator[Relay]:
    """A relay running in a thread, idle polls 30 s apart: what wakes it for a
    scheduled row is its own knowledge of the next due time."""
    running = Relay(dataclasses.replace(settings, poll_interval=30.0))
    running.start()
    thread = threading.Thread(target=running.run)
    thread.start()
    yield running
    running.stop.set()
    thread.join(timeout=30)


def server_now(dsn: str) -> datetime.datetime:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


class Departures:
    """When each watched message left the database for good (its batch committed),
    by the server's clock: polled every 20 ms from a thread."""

    def __init__(self, dsn: str, ids: list[str]) -> None:
        self.left: dict[str, datetime.datetime] = {}
        self._ids, self._dsn, self._done = ids, dsn, threading.Event()
        self._thread = threading.Thread(target=self._watch)
        self._thread.start()

    def _watch(self) -> None:
        with psycopg.connect(self._dsn, autocommit=True) as conn:
            while not self._done.is_set() and len(self.left) < len(self._ids):
                row = conn.execute(
                    "SELECT clock_timestamp(), ARRAY(SELECT message_id::text FROM outbox"
                    " WHERE message_id = ANY(%(ids)s::uuid[]) UNION ALL"
                    " SELECT message_id::text FROM outbox_scheduled"
                    " WHERE message_id = ANY(%(ids)s::uuid[]))",
                    {"ids": self._ids},
                ).fetchone()
                assert row is not None
                for gone in set(self._ids) - set(row[1]) - set(self.left):
                    self.left[gone] = row[0]
                time.sleep(0.02)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=10)


def test_scheduled__row_due_later_is_not_published_early(
    settings: Settings, topology: Topology, relay: Relay
) -> None:
    with psycopg.connect(settings.dsn) as app:
        later = outbox.enqueue(
            app,
            exchange=topology.exchange,
            routing_key="k",
            payload=b"later",
            delay=datetime.timedelta(seconds=2),
        )
        now = outbox.enqueue(app, exchange=topology.exchange, routing_key="k", payload=b"now")
        row = app.execute("SELECT now() + interval '2 seconds'").fetchone()
        assert row is not None
        due = row[0]
    departures = Departures(settings.dsn, [str(later), str(now)])
    try:
        wait_for(lambda: len(departures.left) == 2, 15, "both rows to be published")
    finally:
        departures.stop()
    assert departures.left[str(now)] < due, "the row due now waited for the scheduled one"
    assert departures.left[str(later)] >= due, "the scheduled row was published early"
    lateness = (departures.left[str(later)] - due).total_seconds()
    print(f"lateness {lateness:.3f} s")
    assert lateness < 1.0
    check_delivery(settings.dsn, topology, [str(later), str(now)], max_duplicates=0)


def test_scheduled__plain_sql_deliver_at_waits_until_due(
    settings: Settings, topology: Topology, relay: Relay
) -> None:
    with psycopg.connect(settings.dsn) as app:
        row = app.execute(
            "INSERT INTO outbox (exchange, routing_key, payload, deliver_at)"
            " VALUES (%s, 'k', 'x', now() + interval '1.5 seconds') RETURNING message_id",
            [topology.exchange],
        ).fetchone()
        assert row is None, "a row whose time is ahead is not in the outbox"
        waiting = app.execute("SELECT message_id, deliver_at FROM outbox_scheduled").fetchall()
    assert len(waiting) == 1
    [(message_id, due)] = waiting
    departures = Departures(settings.dsn, [str(message_id)])
    try:
        wait_for(lambda: departures.left, 15, "the scheduled row to be published")
    finally:
        departures.stop()
    assert due <= departures.left[str(message_id)] < due + datetime.timedelta(seconds=1)
    check_delivery(settings.dsn, topology, [str(message_id)], max_duplicates=0)


def test_cancel__cancelled_row_is_never_published(
    settings: Settings, topology: Topology, relay: Relay
) -> None:
    def schedule(payload: bytes) -> uuid.UUID:
        with psycopg.connect(settings.dsn) as app:
            return outbox.enqueue(
                app,
                exchange=topology.exchange,
                routing_key="k",
                payload=payload,
                delay=datetime.timedelta(seconds=1.5),
            )

    kept, cancelled, rolled_back = schedule(b"kept"), schedule(b"cancelled"), schedule(b"kept2")
    with psycopg.connect(settings.dsn) as app:
        assert outbox.cancel(app, cancelled) is True
        assert outbox.cancel(app, cancelled) is False, "already cancelled in this transaction"
        assert outbox.cancel(app, uuid.uuid4()) is False, "unknown"
    with psycopg.connect(settings.dsn) as app:
        assert outbox.cancel(app, rolled_back) is True
        app.rollback()  # the cancel is transactional: the row still goes out
    departures = Departures(settings.dsn, [str(kept), str(rolled_back)])
    try:
        wait_for(lambda: len(departures.left) == 2, 15, "the kept rows to be published")
    finally:
        departures.stop()
    with psycopg.connect(settings.dsn) as app:
        assert outbox.cancel(app, kept) is False, "already published"
    time.sleep(0.5)  # a cancelled row published anyway would arrive with the others
    check_delivery(settings.dsn, topology, [str(kept), str(rolled_back)], max_duplicates=0)


def test_relay__due_rows_go_out_within_1s_while_100k_future_rows_wait(
    settings: Settings, topology: Topology, relay: Relay
) -> None:
    with psycopg.connect(settings.dsn) as app:
        app.execute(
            "INSERT INTO outbox (exchange, routing_key, payload, deliver_at)"
            " SELECT %s, 'future', 'f', now() + interval '1 day' + i * interval '1 second'"
            " FROM generate_series(1, 100000) AS i",
            [topology.exchange],
        )
    with psycopg.connect(settings.dsn) as app:
        ids = [
            outbox.enqueue(
                app,
                exchange=topology.exchange,
                routing_key="due",
                payload=b"due",
                delay=datetime.timedelta(seconds=1 + i * 0.1),
            )
            for i in range(20)
        ]
        dues: dict[str, datetime.datetime] = dict(
            app.execute(
                "SELECT message_id::text, deliver_at FROM outbox_scheduled"
                " WHERE routing_key = 'due'"
            ).fetchall()
        )
    departures = Departures(settings.dsn, [str(i) for i in ids])
    try:
        wait_for(lambda: len(departures.left) == len(ids), 20, "the due rows to be published")
    finally:
        departures.stop()
    lateness = sorted((departures.left[i] - dues[i]).total_seconds() for i in dues)
    print(f"lateness min {lateness[0]:.3f} s, max {lateness[-1]:.3f} s")
    assert lateness[0] >= 0, "a row was published before its time"
    assert lateness[-1] < 1.0
    assert sum(arrived(topology).values()) == len(ids)
    with psycopg.connect(settings.dsn) as conn:
        row = conn.execute("SELECT count(*) FROM outbox_scheduled").fetchone()
    assert row == (100000,)


def test_ordering__a_keys_scheduled_rows_go_out_in_due_order(
    settings: Settings, topology: Topology, relay: Relay
) -> None:
    """A key's rows go out in the order they come due (ties by id): scheduled in the
    reverse of their due order, they arrive in due order, after the key's row due now."""
    with psycopg.connect(settings.dsn) as app:
        written = [
            outbox.enqueue(
                app,
                exchange=topology.exchange,
                routing_key="k",
                payload=str(seconds).encode(),
                ordering_key="order-1",
                delay=datetime.timedelta(seconds=seconds),
            )
            for seconds in (1.6, 1.2, 0.8, 0.0)
        ]
    wait_for(lambda: relay.stats.messages_published == 4, 15, "the key's rows")
    order = [p.message_id for _, p, _ in topology.messages()]
    assert order == [str(i) for i in reversed(written)]


def test_relay__crash_at_the_due_time_loses_nothing(settings: Settings, topology: Topology) -> None:
    """A relay killed right after it moved due rows (committed in the outbox, not yet
    claimed): the next relays publish them; rows it had not moved yet they move."""
    first = RelayProcess(settings, crash_at="after_move")
    try:
        with psycopg.connect(settings.dsn) as app:
            ids = [
                str(
                    outbox.enqueue(
                        app,
                        exchange=topology.exchange,
                        routing_key="k",
                        payload=b"x",
                        ordering_key=f"key-{i % 3}",
                        delay=datetime.timedelta(seconds=1 + (i % 5) * 0.2),
                    )
                )
                for i in range(50)
            ]
        assert first.wait(30) != 0, "the relay did not crash at its move"
    finally:
        first.close()
    # Every row due (none moved after the crash), then two relays, which share the
    # due rows (SKIP LOCKED): each row once.
    wait_for(lambda: scheduled_ahead(settings.dsn) == 0, 15, "every scheduled row to come due")
    successors = [RelayProcess(settings) for _ in range(2)]
    try:
        wait_for(
            lambda: (
                scheduled_ahead(settings.dsn, due_too=True) == 0 and rows_left(settings.dsn) == 0
            ),
            60,
            "the relays to publish every row",
        )
    finally:
        for successor in successors:
            successor.close()
    check_delivery(settings.dsn, topology, ids, max_duplicates=0)


def scheduled_ahead(dsn: str, *, due_too: bool = False) -> int:
    """Scheduled rows not yet due (``due_too``: every scheduled row)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM outbox_scheduled WHERE %s OR deliver_at > now()", [due_too]
        ).fetchone()
    assert row is not None
    return int(row[0])
