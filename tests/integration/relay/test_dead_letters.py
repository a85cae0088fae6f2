"""Bad rows become dead letters with a reason; good rows around them keep flowing."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

import outbox
from outbox.config import Settings
from outbox.relay.process import Relay
from tests.fixtures.faults import RabbitNode
from tests.fixtures.servers import Topology
from tests.integration.relay.test_relay import prepared_left, relay_drain, remaining_rows


def insert(dsn: str, exchange: str, routing_key: str, payload: bytes = b"x", **extra: Any) -> str:
    """One outbox row written with plain SQL (as any application could); its message_id."""
    headers = extra.get("headers")
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload, headers) "
            "VALUES (%s, %s, %s, %s) RETURNING message_id",
            [exchange, routing_key, payload, Jsonb(headers) if headers is not None else None],
        ).fetchone()
    assert row is not None
    return str(row[0])


def dead_letters(dsn: str) -> dict[str, dict[str, Any]]:
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        rows = conn.execute("SELECT * FROM outbox_dead_letters").fetchall()
    return {str(r["message_id"]): r for r in rows}


@pytest.fixture
def internal_exchange(topology: Topology) -> Iterator[str]:
    """An exchange that exists but refuses publishes (403 closes the channel)."""
    name = f"{topology.exchange}.internal"
    ch = topology.channel()
    ch.exchange_declare(name, "topic", durable=False, internal=True)
    yield name
    ch.exchange_delete(name)
    ch.connection.close()


def test_dead_letters__mixed_batch_good_rows_arrive_once_bad_rows_recorded_with_reason(
    settings: Settings, topology: Topology
) -> None:
    small = dataclasses.replace(settings, max_message_bytes=1000)
    ex = topology.exchange
    good = [insert(small.dsn, ex, f"good.{i}") for i in range(5)]
    bad = {
        insert(small.dsn, f"{ex}.missing", "k"): "does not exist",
        insert(small.dsn, "", f"no.such.queue.{uuid.uuid4().hex}"): "unroutable",
        insert(small.dsn, ex, "r" * 256): "routing_key is 256 bytes",
        insert(small.dsn, "x" * 300, "k"): "exchange is 300 bytes",
        insert(small.dsn, ex, "big", b"p" * 1001): "payload is 1001 bytes",
        insert(small.dsn, ex, "f", headers={"price": 1.5}): "floating-point",
        insert(small.dsn, ex, "i", headers={"n": 2**64}): "64-bit",
        insert(small.dsn, ex, "n", headers={"deep": [{"x": 0.1}]}): "headers.deep[0].x",
    }
    good += [insert(small.dsn, ex, f"good.late.{i}") for i in range(5)]

    relay = relay_drain(small)

    delivered = Counter(p.message_id for _, p, _ in topology.messages())
    assert delivered == Counter(good), "every good row exactly once, no bad row"
    letters = dead_letters(small.dsn)
    assert set(letters) == set(bad)
    for message_id, expected in bad.items():
        assert expected in letters[message_id]["reason"]
        assert letters[message_id]["attempts"] == 1, "dead-lettered on the first attempt"
        assert letters[message_id]["gid"].startswith("obx:outbox:")
    assert relay.stats.dead_letters == len(bad)
    assert relay.stats.messages_published == len(good)
    assert relay.stats.batches_rolled_back == 0
    assert remaining_rows(small.dsn) == 0
    assert prepared_left(small.dsn) == []


def test_dead_letters__keep_payload_headers_and_destination_for_a_retry(
    settings: Settings, topology: Topology
) -> None:
    message_id = insert(
        settings.dsn, f"{topology.exchange}.missing", "order.created", b"\x00\x01", headers={"a": 1}
    )
    relay_drain(settings)
    letter = dead_letters(settings.dsn)[message_id]
    assert (letter["exchange"], letter["routing_key"]) == (
        f"{topology.exchange}.missing",
        "order.created",
    )
    assert bytes(letter["payload"]) == b"\x00\x01"
    assert letter["headers"] == {"a": 1}


def test_dead_letters__exchange_refusing_publishes_costs_one_rollback_then_dead_letters(
    settings: Settings, topology: Topology, internal_exchange: str
) -> None:
    # The refused row comes first: the broker closes the channel on it and discards
    # what follows, so the good rows are not duplicated by the one rollback.
    refused = insert(settings.dsn, internal_exchange, "k")
    good = [insert(settings.dsn, topology.exchange, f"good.{i}") for i in range(3)]

    relay = relay_drain(settings)

    assert Counter(p.message_id for _, p, _ in topology.messages()) == Counter(good)
    letters = dead_letters(settings.dsn)
    assert set(letters) == {refused}
    assert "refuses publishes" in letters[refused]["reason"]
    assert "internal exchange" in letters[refused]["reason"]
    assert relay.stats.batches_rolled_back == 1
    assert relay.stats.dead_letters == 1
    assert remaining_rows(settings.dsn) == 0
    assert prepared_left(settings.dsn) == []


def test_dead_letters__nacked_batch_is_retried_never_dead_lettered(
    settings: Settings, topology: Topology
) -> None:
    """A queue that rejects publishes when full nacks them: transient, so retried."""
    full_exchange = f"{topology.exchange}.full"
    full_queue = f"{topology.queue}.full"
    roomy_queue = f"{topology.queue}.roomy"
    ch = topology.channel()
    ch.exchange_declare(full_exchange, "fanout", auto_delete=False)
    ch.queue_declare(full_queue, arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    ch.queue_bind(full_queue, full_exchange)
    ch.basic_publish(full_exchange, "", b"fills the queue")
    ids = [insert(settings.dsn, full_exchange, "k") for _ in range(3)]

    relay = Relay(settings)
    relay.start()
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while relay.stats.batches_rolled_back < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert relay.stats.batches_rolled_back >= 2, "nacks roll back and retry"
        assert relay.stats.dead_letters == 0
        assert dead_letters(settings.dsn) == {}
        assert remaining_rows(settings.dsn) == 3

        # The cause goes away (with no instant of "unroutable"): the same rows go
        # through, none was lost.
        ch.queue_declare(roomy_queue)
        ch.queue_bind(roomy_queue, full_exchange)
        ch.queue_delete(full_queue)
        deadline = time.monotonic() + 20
        while remaining_rows(settings.dsn) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        relay.stop.set()
        thread.join(timeout=20)
        ch.exchange_delete(full_exchange)
    got = []
    for method, props, _body in ch.consume(roomy_queue, inactivity_timeout=0.5):
        if method is None:
            break
        got.append(props.message_id)
    ch.queue_delete(roomy_queue)
    ch.connection.close()
    assert sorted(got) == sorted(ids)
    assert dead_letters(settings.dsn) == {}
    assert prepared_left(settings.dsn) == []


def test_dead_letters__pika_encoding_failure_is_dead_lettered_not_retried(
    settings: Settings, topology: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defence in depth: if the static check misses a value pika cannot encode."""
    monkeypatch.setattr("outbox.relay.triage.problem_with", lambda row, limit: None)
    good = insert(settings.dsn, topology.exchange, "good")
    bad = insert(settings.dsn, topology.exchange, "bad", headers={"price": 2.5})
    huge = insert(settings.dsn, topology.exchange, "huge", headers={"n": -(2**70)})

    relay = relay_drain(settings)

    assert [p.message_id for _, p, _ in topology.messages()] == [good]
    letters = dead_letters(settings.dsn)
    assert set(letters) == {bad, huge}
    assert all("cannot be encoded" in letter["reason"] for letter in letters.values())
    assert relay.stats.batches_rolled_back == 0


def test_dead_letters__row_enqueued_through_the_api_with_a_float_header(
    settings: Settings, topology: Topology
) -> None:
    with psycopg.connect(settings.dsn) as conn:
        message_id = outbox.enqueue(
            conn, exchange=topology.exchange, routing_key="k", payload=b"1", headers={"f": 0.5}
        )
    relay_drain(settings)
    assert topology.messages() == []
    assert "floating-point" in dead_letters(settings.dsn)[str(message_id)]["reason"]


def test_dead_letters__payload_over_the_brokers_real_limit_costs_one_rollback_not_a_loop(
    settings: Settings, rabbit_node: RabbitNode, node_topology: Topology
) -> None:
    """--max-message-bytes above the broker's max_message_size: the 406 names the limit.

    Runs on a private node whose limit is lowered (never the shared broker).
    """
    rabbit_node.ctl("eval", "application:set_env(rabbit, max_message_size, 4096).")
    on_node = dataclasses.replace(
        settings, amqp_url=node_topology.amqp_url, ledger_queue=node_topology.ledger
    )
    ex = node_topology.exchange
    # The oversized row first: the broker discards what follows it on the closed
    # channel, so the one rollback duplicates nothing.
    too_big = insert(on_node.dsn, ex, "big", b"b" * 5000)
    good = [insert(on_node.dsn, ex, f"good.{i}", b"g" * 4000) for i in range(3)]

    relay = relay_drain(on_node)

    assert Counter(p.message_id for _, p, _ in node_topology.messages()) == Counter(good)
    letters = dead_letters(on_node.dsn)
    assert set(letters) == {too_big}
    assert "payload is 5000 bytes" in letters[too_big]["reason"]
    assert "4096" in letters[too_big]["reason"]
    assert relay.stats.batches_rolled_back == 1, "one rollback teaches the relay the limit"
    assert remaining_rows(on_node.dsn) == 0
    assert prepared_left(on_node.dsn) == []
