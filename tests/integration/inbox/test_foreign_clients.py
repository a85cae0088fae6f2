"""Issue 18: what raw AMQP clients on a shared queue can send that py-amqp and
kombu, left to themselves, would choke on or change: every such message still
ends in exactly one place, with the body exactly as it arrived."""

from __future__ import annotations

import struct
import sys
import time
import urllib.parse
import zlib
from pathlib import Path

import amqp
import pika

from outbox.amqp.properties import HEADERS_FLAG
from outbox.db.inbox import ParkedStore
from outbox.inbox import parked
from tests.fixtures.servers import Topology
from tests.integration.inbox.support import (
    INBOX,
    consumer,
    effect_bodies,
    parked_bodies,
    publish,
    rows,
    wait_settled,
)

MESSAGE_ID_FLAG = 0x0080


def test_foreign__a_routing_key_that_is_not_utf8_is_applied_or_parked(
    topology: Topology, consumer_dsn: str, tmp_path: Path
) -> None:
    """py-amqp decodes the deliver method strictly: "unexpected UnicodeDecodeError",
    exit 1 on every start."""
    ch = topology.channel()
    ch.confirm_delivery()
    for message_id, body in [("rk-ok", b"ok:rk"), ("rk-fails", b"raise:rk")]:
        props = pika.BasicProperties(message_id=message_id, delivery_mode=2)
        ch.basic_publish(topology.exchange, b"\xff\xfe.key", body, props)
    ch.connection.close()
    publish(topology, [("g", b"ok:g")])
    with consumer(tmp_path, consumer_dsn, topology, max_attempts=1):
        wait_settled(consumer_dsn, topology, [b"ok:rk", b"raise:rk", b"ok:g"], 30)
    assert sorted(effect_bodies(consumer_dsn)) == [b"ok:g", b"ok:rk"]
    assert parked_bodies(consumer_dsn) == [b"raise:rk"]


def test_foreign__the_body_is_what_arrived_whatever_its_encoding_says(
    topology: Topology, consumer_dsn: str, tmp_path: Path
) -> None:
    """content_encoding naming a text codec: py-amqp handed on a str body ("unexpected
    TypeError", exit 1 on every start), as it did for an empty body; a
    `compression` header: kombu decompressed the body, so the parked (and retried)
    body was not the one that arrived."""
    zipped = zlib.compress(b"raise:zipped")
    publish(topology, [("text", b"ok:text")], content_encoding="utf-8")
    publish(topology, [("zipped", zipped)], headers={"compression": "application/x-gzip"})
    publish(topology, [("empty", b""), ("g", b"ok:g")])
    with consumer(tmp_path, consumer_dsn, topology, max_attempts=1):
        wait_settled(consumer_dsn, topology, [b"ok:text", zipped, b"", b"ok:g"], 30)
    assert sorted(effect_bodies(consumer_dsn)) == [b"ok:g", b"ok:text"]
    assert sorted(parked_bodies(consumer_dsn)) == sorted([zipped, b""])


def test_foreign__headers_nested_hundreds_deep_are_parked(
    topology: Topology, consumer_dsn: str, tmp_path: Path
) -> None:
    """py-amqp reads a table nested 600 deep, but keeping it as JSON for the parked
    row hit Python's recursion limit: "unexpected RecursionError", exit 1 on every
    start."""
    deep: dict[str, object] = {"leaf": 1}
    for _ in range(600):
        deep = {"k": deep}
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)  # pika encodes tables recursively too
    try:
        publish(topology, [(None, b"ok:no-id"), ("deep", b"raise:deep")], headers=deep)
    finally:
        sys.setrecursionlimit(limit)
    publish(topology, [("g", b"ok:g")])
    with consumer(tmp_path, consumer_dsn, topology, max_attempts=1):
        wait_settled(consumer_dsn, topology, [b"ok:no-id", b"raise:deep", b"ok:g"], 30)
    assert effect_bodies(consumer_dsn) == [b"ok:g"]
    assert sorted(parked_bodies(consumer_dsn)) == [b"ok:no-id", b"raise:deep"]


def _publish_raw(topology: Topology, body: bytes, raw_properties: bytes, copies: int) -> None:
    """Publish with a property list given as bytes (values pika cannot write)."""

    class Raw(amqp.Message):  # type: ignore[misc]
        def _serialize_properties(self) -> bytes:
            return raw_properties

    host, port = urllib.parse.urlsplit(topology.amqp_url).netloc.split("@")[-1].split(":")
    conn = amqp.Connection(f"{host}:{port}", userid="guest", password="guest")
    conn.connect()
    try:
        channel = conn.channel()
        channel.confirm_select()
        for _ in range(copies):
            channel.basic_publish_confirm(Raw(body), exchange="", routing_key=topology.queue)
    finally:
        conn.close()


def test_foreign__a_header_py_amqp_cannot_read_parks_the_message_under_its_id(
    topology: Topology, consumer_dsn: str, tmp_path: Path
) -> None:
    """A timestamp header past year 9999 (RabbitMQ takes it) made the whole property
    list unreadable: the message was parked without its message_id, so each copy
    was parked again and `parked retry` could not send it back."""
    table = b"\x01t" + b"T" + struct.pack(">Q", 2**40)
    raw = struct.pack(">HI", HEADERS_FLAG | MESSAGE_ID_FLAG, len(table)) + table + b"\x03far"
    _publish_raw(topology, b"ok:far", raw, copies=2)
    publish(topology, [("g", b"ok:g")])
    with consumer(tmp_path, consumer_dsn, topology):
        wait_settled(consumer_dsn, topology, [b"ok:far", b"ok:g"], 30)
    assert effect_bodies(consumer_dsn) == [b"ok:g"]
    parked = rows(consumer_dsn, f"SELECT message_id, error FROM {INBOX}_parked")
    assert [message_id for message_id, _ in parked] == ["far"]
    assert "application_headers" in parked[0][1]


def test_foreign__a_retried_message_with_an_expiration_is_not_lost_while_no_one_consumes(
    topology: Topology, consumer_dsn: str, tmp_path: Path
) -> None:
    """`parked retry` sent the per-message TTL back too: retried while the consumer
    was stopped (fix the handler, retry, deploy), RabbitMQ dropped the message after
    its TTL, and it was neither parked nor applied."""
    with consumer(tmp_path, consumer_dsn, topology, max_attempts=1):
        # Published once the consumer is up: a consumer slow to start on a busy
        # machine would otherwise let RabbitMQ drop it first (a flaky test).
        publish(topology, [("ttl", b"raise:ttl")], expiration="1000")
        wait_settled(consumer_dsn, topology, [b"raise:ttl"], 30)
    store = ParkedStore(consumer_dsn, INBOX)
    try:
        assert parked.retry(store, topology.amqp_url, None) == ["ttl"]
    finally:
        store.close()
    time.sleep(1.5)  # longer than the message's TTL, no consumer running
    with consumer(tmp_path, consumer_dsn, topology, max_attempts=1):
        wait_settled(consumer_dsn, topology, [b"raise:ttl"], 30)
    assert parked_bodies(consumer_dsn) == [b"raise:ttl"]


def test_foreign__a_header_table_near_frame_max_can_be_retried_and_blocks_no_other(
    topology: Topology, consumer_dsn: str, tmp_path: Path
) -> None:
    """The two routing headers pushed its content header past frame_max: RabbitMQ
    closed the connection (FRAME_ERROR), so it could never be sent back, and every
    `parked retry --all` stopped at it, the rest of its batch too."""
    # frame_max 131072: 8 bytes of frame, 12 of content header, the property list
    # (flags 2, table length 4, key 1+1, type and length 5, delivery mode 1, id 1+3).
    text = "x" * (131072 - 8 - 12 - 2 - 4 - 2 - 5 - 1 - 4 - 40)
    publish(topology, [("big", b"raise:big")], headers={"h": text})
    publish(topology, [("small", b"raise:small")])
    with consumer(tmp_path, consumer_dsn, topology, max_attempts=1):
        wait_settled(consumer_dsn, topology, [b"raise:big", b"raise:small"], 30)
    store = ParkedStore(consumer_dsn, INBOX)
    try:
        assert parked.retry(store, topology.amqp_url, None) == ["big", "small"]
    finally:
        store.close()
    (_, big_props, big), (_, _, small) = topology.messages()
    assert (big, small) == (b"raise:big", b"raise:small")
    assert big_props.headers["h"] == text
