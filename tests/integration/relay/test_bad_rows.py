"""Rows that share a message_id, overflow the frame, or cannot even be loaded.

Issue 9, items 1-3: whatever a committed row holds, it ends in exactly one place
(delivered once, or a dead letter with a reason), and the relay keeps running.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from outbox.amqp.publisher import Publisher
from outbox.config import Settings
from outbox.db import migrate
from outbox.db.batches import BatchStore
from outbox.ops import status
from outbox.relay.process import Relay
from tests.fixtures.faults import both_modes, prepared_left
from tests.fixtures.servers import Topology
from tests.integration.relay.test_relay import relay_drain, remaining_rows

SHARED = "33333333-3333-3333-3333-333333333331"


def dead_letter_rows(dsn: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        return conn.execute("SELECT * FROM outbox_dead_letters ORDER BY id").fetchall()


@both_modes
def test_shared_message_id__each_row_ends_in_its_own_place(
    settings: Settings, topology: Topology
) -> None:
    """Item 1: two rows with one message_id, one routable and one not (5/5 lost before)."""
    with psycopg.connect(settings.dsn) as conn:
        conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload, message_id) VALUES "
            "(%(ex)s, 'k', 'before', gen_random_uuid()), "
            "('', %(queue)s, 'to-queue', %(shared)s), "
            "('', %(nowhere)s, 'unroutable', %(shared)s), "
            "(%(ex)s, 'k', 'after', gen_random_uuid())",
            {
                "ex": topology.exchange,
                "queue": topology.queue,
                "nowhere": f"nowhere.{uuid.uuid4().hex}",
                "shared": SHARED,
            },
        )

    relay = relay_drain(settings)

    bodies = Counter(body for _, _, body in topology.messages())
    assert bodies == Counter({b"before": 1, b"to-queue": 1, b"after": 1})
    [letter] = dead_letter_rows(settings.dsn)
    assert bytes(letter["payload"]) == b"unroutable"
    assert str(letter["message_id"]) == SHARED
    assert "unroutable" in letter["reason"]
    assert relay.stats.messages_published == 3
    assert relay.stats.dead_letters == 1
    assert remaining_rows(settings.dsn) == 0
    assert prepared_left(settings.dsn) == []


def test_shared_message_id__two_dead_letters_stay_two(
    settings: Settings, topology: Topology
) -> None:
    """Item 1: the dead letters table no longer merges rows that share an id."""
    with psycopg.connect(settings.dsn) as conn:
        conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload, message_id) VALUES "
            "(%(missing)s, 'k', 'first', %(shared)s), "
            "('', %(nowhere)s, 'second', %(shared)s)",
            {
                "missing": f"{topology.exchange}.missing",
                "nowhere": f"nowhere.{uuid.uuid4().hex}",
                "shared": SHARED,
            },
        )

    relay = relay_drain(settings)

    letters = dead_letter_rows(settings.dsn)
    assert sorted(bytes(r["payload"]) for r in letters) == [b"first", b"second"]
    assert {str(r["message_id"]) for r in letters} == {SHARED}
    reasons = sorted(r["reason"] for r in letters)
    assert "does not exist" in reasons[0] and "unroutable" in reasons[1]
    assert relay.stats.dead_letters == 2
    assert topology.messages() == []
    assert remaining_rows(settings.dsn) == 0


class RunningRelay:
    """A relay in a thread, as in production: it runs until told to stop."""

    def __init__(self, settings: Settings) -> None:
        self.relay = Relay(settings)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.relay.start()
            self.relay.run()
        except BaseException as exc:  # the test reports it: a relay must never die of a row
            self.error = exc

    def __enter__(self) -> RunningRelay:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.relay.stop.set()
        self.thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.error is None

    def wait_until_empty(self, dsn: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while remaining_rows(dsn) or prepared_left(dsn):
            assert self.alive, f"the relay died: {self.error!r}"
            assert time.monotonic() < deadline, (
                f"rows still waiting after {timeout}s: {self.relay.stats}"
            )
            time.sleep(0.05)


def test_header_over_frame_max__is_a_dead_letter_and_the_table_flows(
    settings: Settings, topology: Topology
) -> None:
    """Item 2: a 200 kB header made the broker close with 501, forever (367 duplicates)."""
    with psycopg.connect(settings.dsn) as conn:
        conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload, headers) VALUES "
            "(%(ex)s, 'k', 'before', NULL), "
            "(%(ex)s, 'k', 'big', jsonb_build_object('big', repeat('v', 200000))), "
            "(%(ex)s, 'k', 'after', NULL)",
            {"ex": topology.exchange},
        )

    with RunningRelay(settings) as running:
        running.wait_until_empty(settings.dsn, timeout=20)
        assert running.alive
    relay = running.relay

    bodies = Counter(body for _, _, body in topology.messages())
    assert bodies == Counter({b"before": 1, b"after": 1})
    [letter] = dead_letter_rows(settings.dsn)
    assert bytes(letter["payload"]) == b"big"
    assert "frame_max" in letter["reason"] and "131072" in letter["reason"]
    assert relay.stats.batches_rolled_back == 0
    assert relay.stats.duplicates_possible == 0


def test_unloadable_created_at_and_deep_headers__are_dead_letters_naming_the_column(
    settings: Settings, topology: Topology
) -> None:
    """Item 3: rows psycopg or json cannot load crashed the relay on every start."""
    deep = "[" * 1000 + "]" * 1000
    with psycopg.connect(settings.dsn) as conn:
        conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload, created_at, headers) VALUES "
            "(%(ex)s, 'k', 'before', now(), NULL), "
            "(%(ex)s, 'k', 'infinite', 'infinity', NULL), "
            "(%(ex)s, 'k', 'minus-infinite', '-infinity', NULL), "
            "(%(ex)s, 'k', 'year-1', '0001-01-01 00:00:00+00', NULL), "
            "(%(ex)s, 'k', 'year-20000', '20000-01-01 00:00:00+00', NULL), "
            "(%(ex)s, 'k', 'deep', now(), jsonb_build_object('d', %(deep)s::jsonb)), "
            "(%(ex)s, 'k', 'year-9999', '9999-12-31 23:59:59+00', NULL), "
            "(%(ex)s, 'k', 'after', now(), NULL)",
            {"ex": topology.exchange, "deep": deep},
        )
        originals = {
            bytes(r[0]): (r[1], r[2])
            for r in conn.execute(
                "SELECT payload, created_at::text, headers::text FROM outbox"
            ).fetchall()
        }

    with RunningRelay(settings) as running:
        running.wait_until_empty(settings.dsn, timeout=20)
        assert running.alive

    got = {body: props for _, props, body in topology.messages()}
    assert set(got) == {b"before", b"year-9999", b"after"}
    assert got[b"year-9999"].timestamp == 253402300799
    with psycopg.connect(settings.dsn) as conn:
        letters = {
            bytes(r[0]): (r[1], r[2], r[3])
            for r in conn.execute(
                "SELECT payload, reason, created_at::text, headers::text FROM outbox_dead_letters"
            ).fetchall()
        }
    assert set(letters) == {b"infinite", b"minus-infinite", b"year-1", b"year-20000", b"deep"}
    for payload, (reason, created_at, headers) in letters.items():
        column = "headers" if payload == b"deep" else "created_at"
        assert column in reason, (payload, reason)
        assert (created_at, headers) == originals[payload], "the original values are kept"


def insert_around(dsn: str, exchange: str, bad_headers: str) -> None:
    """An unroutable row, two good rows, the bad one, two good rows: one batch."""
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload, headers) VALUES "
            "('', %(nowhere)s, 'unroutable', NULL), "
            "(%(ex)s, 'k', 'good-1', NULL), (%(ex)s, 'k', 'good-2', NULL), "
            f"(%(ex)s, 'k', 'bad', {bad_headers}), "
            "(%(ex)s, 'k', 'good-3', NULL), (%(ex)s, 'k', 'good-4', NULL)",
            {"ex": exchange, "nowhere": f"nowhere.{uuid.uuid4().hex}"},
        )


def assert_isolated(settings: Settings, topology: Topology, relay: Relay, code: str) -> None:
    bodies = Counter(body for _, _, body in topology.messages())
    assert set(bodies) == {b"good-1", b"good-2", b"good-3", b"good-4"}, "every good row arrived"
    [unroutable, bad] = dead_letter_rows(settings.dsn)
    assert bytes(unroutable["payload"]) == b"unroutable" and "312 NO_ROUTE" in unroutable["reason"]
    assert bytes(bad["payload"]) == b"bad"
    assert "refused it 2 times when it was published alone" in bad["reason"]
    assert code in bad["reason"]
    # One refused batch, then two refusals of the bad row alone: it converges.
    assert relay.stats.batches_rolled_back == 3
    duplicates = sum(n - 1 for n in bodies.values())
    assert duplicates <= relay.stats.duplicates_possible, "every re-send is counted"
    assert relay.stats.dead_letters == 2


@both_modes
def test_refusal_nobody_foresaw__the_row_is_isolated_and_dead_lettered(
    settings: Settings, topology: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 2, the general rule: a channel close (406) the static checks miss."""
    monkeypatch.setattr("outbox.relay.triage.problem_with", lambda row, limit: None)
    insert_around(settings.dsn, topology.exchange, "'{\"CC\": 5}'")

    with RunningRelay(settings) as running:
        running.wait_until_empty(settings.dsn, timeout=30)
        assert running.alive

    assert_isolated(settings, topology, running.relay, "406 PRECONDITION_FAILED")


@both_modes
def test_connection_refused_by_frame_error__the_row_is_isolated_and_dead_lettered(
    settings: Settings, topology: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 2, the general rule when the broker closes the whole connection (501)."""
    monkeypatch.setattr(Publisher, "frame_max", property(lambda self: None))
    insert_around(settings.dsn, topology.exchange, "jsonb_build_object('big', repeat('v', 200000))")

    with RunningRelay(settings) as running:
        running.wait_until_empty(settings.dsn, timeout=30)
        assert running.alive

    assert_isolated(settings, topology, running.relay, "501 FRAME_ERROR")


def test_publisher__frame_max_is_the_negotiated_value(topology: Topology) -> None:
    """Pins where the frame limit comes from (pika's public connection params)."""
    publisher = Publisher(topology.amqp_url)
    assert publisher.frame_max is None
    publisher.connect()
    try:
        assert publisher.frame_max == 131072  # RabbitMQ's default frame_max
    finally:
        publisher.close()


def test_migration_0002__keeps_old_dead_letters_and_keys_them_by_row_id(empty_dsn: str) -> None:
    """An outbox created at version 1 (dead letters keyed by message_id) upgrades in place."""
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        migrate.migrate(conn, "outbox", target=1)  # type: ignore[arg-type]
        conn.execute("INSERT INTO outbox (routing_key) SELECT 'k' FROM generate_series(1, 3)")
        conn.execute(
            "INSERT INTO outbox_dead_letters (message_id, exchange, routing_key, payload, "
            "created_at, reason) VALUES (%s, '', 'k', 'old', now(), 'from version 1')",
            [SHARED],
        )

        before, after = migrate.migrate(conn, "outbox")  # type: ignore[arg-type]

        assert (before, after) == (1, migrate.LATEST_VERSION)
        [(old_id, reason)] = conn.execute("SELECT id, reason FROM outbox_dead_letters").fetchall()
        assert reason == "from version 1"
        assert old_id > 3, "a fresh id from the outbox's sequence, never a row's"
        conn.execute(
            "INSERT INTO outbox_dead_letters (id, message_id, exchange, routing_key, payload, "
            "created_at, reason) VALUES (1, %s, '', 'k', 'twin', now(), 'same message_id')",
            [SHARED],
        )
        [(count,)] = conn.execute(
            "SELECT count(*) FROM outbox_dead_letters WHERE message_id = %s", [SHARED]
        ).fetchall()
        assert count == 2


@pytest.mark.parametrize("created_at", ["-infinity", "infinity"])
def test_status_and_metrics__read_a_table_holding_an_infinite_created_at(
    settings: Settings, created_at: str
) -> None:
    """Item 3 beyond the relay loop: `now() - '-infinity'` is out of range in SQL."""
    with psycopg.connect(settings.dsn) as conn:
        conn.execute(
            "INSERT INTO outbox (routing_key, created_at) VALUES ('k', %s), ('k', now())",
            [created_at],
        )
    report = status.collect(settings, max_prepared_age=60)
    assert report["backlog_rows"] == 2
    store = BatchStore(settings.dsn, settings.table)
    try:
        snapshot = store.metrics_snapshot()
    finally:
        store.close()
    assert snapshot["backlog_rows"] == 2
    assert snapshot["oldest_row_age_seconds"] >= 0
