"""The relay end to end against real PostgreSQL and RabbitMQ, with no faults."""

from __future__ import annotations

import datetime
import json
import threading
import uuid
from collections import Counter

import psycopg
import pytest
from psycopg.rows import dict_row

import outbox
from outbox.amqp import ledger
from outbox.config import Settings
from outbox.relay.process import Relay
from tests.fixtures.faults import prepared_left
from tests.fixtures.servers import Topology, insert_numbered_rows


def relay_drain(settings: Settings) -> Relay:
    relay = Relay(settings)
    relay.start()
    relay.run(drain=True)
    return relay


def remaining_rows(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT count(*) FROM outbox").fetchone()[0]  # type: ignore[index]


def test_relay__plain_sql_row_arrives_once_with_its_properties(
    settings: Settings, topology: Topology
) -> None:
    with psycopg.connect(settings.dsn) as conn:
        row = conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload, headers, content_type) "
            'VALUES (%s, \'order.created\', \'{"id": 1}\', \'{"tenant": "acme", "n": 7}\', '
            "'application/json') RETURNING message_id, created_at",
            [topology.exchange],
        ).fetchone()
    assert row is not None
    message_id, created_at = row

    relay_drain(settings)

    [(method, props, body)] = topology.messages()
    assert body == b'{"id": 1}'
    assert method.routing_key == "order.created"
    assert method.exchange == topology.exchange
    assert props.message_id == str(message_id)
    assert props.delivery_mode == 2
    assert props.content_type == "application/json"
    assert props.headers == {"tenant": "acme", "n": 7}
    assert props.timestamp == int(created_at.timestamp())
    assert remaining_rows(settings.dsn) == 0
    assert prepared_left(settings.dsn) == []


def test_relay__api_rows_arrive_exactly_once(settings: Settings, topology: Topology) -> None:
    with psycopg.connect(settings.dsn) as conn:
        ids = {
            outbox.enqueue(conn, exchange=topology.exchange, routing_key="a", payload=b"raw"),
            outbox.enqueue_json(
                conn, exchange=topology.exchange, routing_key="b", body={"x": [1, 2]}
            ),
            *outbox.enqueue_many(
                conn,
                [
                    outbox.OutgoingMessage(topology.exchange, f"c.{i}", f"m{i}".encode())
                    for i in range(250)
                ],
            ),
        }
    relay = relay_drain(settings)

    got = topology.messages()
    counts = Counter(props.message_id for _, props, _ in got)
    assert set(counts) == {str(i) for i in ids}
    assert max(counts.values()) == 1
    bodies = {props.message_id: (props.content_type, body) for _, props, body in got}
    json_id = next(i for i in ids if bodies[str(i)][0] == "application/json")
    assert json.loads(bodies[str(json_id)][1]) == {"x": [1, 2]}
    assert relay.stats.messages_published == 252
    assert relay.stats.batches_committed == 3  # batch_size 100
    assert remaining_rows(settings.dsn) == 0


def test_enqueue__rolled_back_transaction_publishes_nothing(
    settings: Settings, topology: Topology
) -> None:
    with psycopg.connect(settings.dsn) as conn:
        with conn.transaction():
            outbox.enqueue(conn, exchange=topology.exchange, routing_key="kept", payload=b"1")
        with pytest.raises(ZeroDivisionError), conn.transaction():
            outbox.enqueue(conn, exchange=topology.exchange, routing_key="lost", payload=b"2")
            raise ZeroDivisionError
    relay_drain(settings)
    assert [m.routing_key for m, _, _ in topology.messages()] == ["kept"]


def test_enqueue__never_commits_on_its_own(settings: Settings, topology: Topology) -> None:
    conn = psycopg.connect(settings.dsn)
    outbox.enqueue(conn, exchange=topology.exchange, routing_key="x", payload=b"1")
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    conn.rollback()
    conn.close()
    assert remaining_rows(settings.dsn) == 0


async def _enqueue_async(dsn: str, exchange: str) -> list[uuid.UUID]:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        first = await outbox.enqueue_async(conn, exchange=exchange, routing_key="a", payload=b"1")
        second = await outbox.enqueue_json_async(conn, exchange=exchange, routing_key="b", body=[1])
        rest = await outbox.enqueue_many_async(conn, [outbox.OutgoingMessage(exchange, "c", b"3")])
    return [first, second, *rest]


def test_enqueue__async_connection(settings: Settings, topology: Topology) -> None:
    import asyncio

    ids = asyncio.run(_enqueue_async(settings.dsn, topology.exchange))
    relay_drain(settings)
    assert sorted(p.message_id for _, p, _ in topology.messages()) == sorted(map(str, ids))


def test_enqueue__payload_must_be_bytes(settings: Settings) -> None:
    with psycopg.connect(settings.dsn) as conn, pytest.raises(TypeError, match="enqueue_json"):
        outbox.enqueue(conn, exchange="", routing_key="q", payload={"a": 1})  # type: ignore[arg-type]


def test_relay__several_relays_share_the_table_without_duplicates(
    settings: Settings, topology: Topology
) -> None:
    total = 3000
    insert_numbered_rows(settings.dsn, topology.exchange, total)
    relays = [Relay(settings) for _ in range(3)]
    for relay in relays:
        relay.start()
    threads = [threading.Thread(target=r.run, kwargs={"drain": True}) for r in relays]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)

    got = topology.messages()
    bodies = Counter(body for _, _, body in got)
    assert len(bodies) == total
    assert max(bodies.values()) == 1
    assert all(r.stats.messages_published > 0 for r in relays), "every relay took a share"
    assert sum(r.stats.messages_published for r in relays) == total
    assert remaining_rows(settings.dsn) == 0
    assert prepared_left(settings.dsn) == []


def test_relay__records_every_committed_batch_in_the_ledger(
    settings: Settings, topology: Topology
) -> None:
    with psycopg.connect(settings.dsn) as conn:
        conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload) "
            "SELECT %s, 'k', 'x' FROM generate_series(1, 250)",
            [topology.exchange],
        )
    committed: list[str] = []
    relay = Relay(settings, on_batch=lambda gid, _stats: committed.append(gid))
    relay.start()
    relay.run(drain=True)
    recorded = ledger.finished_gids(
        settings.amqp_url,
        settings.ledger_queue,
        since=datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5),
    )
    assert len(committed) == 3
    assert set(committed) == recorded


def test_relay__wakes_on_notify_without_waiting_for_the_poll(
    settings: Settings, topology: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses
    import time

    # The fallback poll rides on the heartbeat, and an idle relay also polls early
    # and then less often (``WakeupListener.poll_pause``): make the polls slow and
    # blind, so only the NOTIFY from the application's commit can wake the relay.
    slow_poll = dataclasses.replace(
        settings, poll_interval=30.0, heartbeat_interval=30.0, relay_timeout=90.0
    )
    relay = Relay(slow_poll)
    relay.start()
    assert relay.wakeups is not None
    wakeups = relay.wakeups
    monkeypatch.setattr(wakeups, "rows_waiting", lambda *_: False)
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        deadline = time.monotonic() + 15
        while not wakeups.wanting and time.monotonic() < deadline:  # idle, waiting
            time.sleep(0.01)
        assert wakeups.wanting
        with psycopg.connect(settings.dsn) as conn:
            outbox.enqueue(conn, exchange=topology.exchange, routing_key="k", payload=b"1")
        deadline = time.monotonic() + 15
        while relay.stats.messages_published == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert relay.stats.messages_published == 1
    finally:
        relay.stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive()


def test_relay__without_the_notify_trigger_finds_rows_by_its_poll(
    settings: Settings, topology: Topology
) -> None:
    """docs/explanation/design.md, "Wake-ups": the wake-up trigger may be disabled; the relay
    then finds every row by its fallback poll."""
    import dataclasses
    import time

    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE outbox DISABLE TRIGGER outbox_notify")
    relay = Relay(dataclasses.replace(settings, poll_interval=0.1))
    relay.start()
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        time.sleep(0.3)  # the relay is idle, waiting
        with psycopg.connect(settings.dsn) as conn:
            conn.execute("LISTEN outbox")
            for i in range(5):
                with conn.transaction():
                    outbox.enqueue(
                        conn, exchange=topology.exchange, routing_key="k", payload=b"%d" % i
                    )
            assert not list(conn.notifies(timeout=0.2)), "the trigger was not disabled"
        deadline = time.monotonic() + 15
        while relay.stats.messages_published < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert relay.stats.messages_published == 5
    finally:
        relay.stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive()


def test_relay__registers_and_unregisters(settings: Settings) -> None:
    relay = Relay(settings)
    relay.start()
    with psycopg.connect(settings.dsn, row_factory=dict_row) as conn:
        [row] = conn.execute("SELECT * FROM outbox_relays").fetchall()
        assert row["relay_id"] == relay.relay_id
    relay.run(drain=True)
    with psycopg.connect(settings.dsn) as conn:
        assert conn.execute("SELECT count(*) FROM outbox_relays").fetchone() == (0,)
