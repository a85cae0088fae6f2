"""Issue 18, items 2 and 5: a parked message keeps its properties and headers byte
for byte, ``parked retry`` sends back exactly what arrived, and sends each parked
message at most once per call, counting what it sent."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pika
import psycopg
import pytest

from outbox.db.inbox import InboxStore, ParkedStore
from outbox.inbox import parked
from tests.fixtures.faults import wait_for
from tests.fixtures.servers import Topology
from tests.integration.inbox.support import (
    INBOX,
    consumer,
    parked_bodies,
    publish,
    scalar,
    wait_settled,
)


def test_retry__sends_each_parked_message_once_while_the_handler_still_fails(
    topology: Topology, consumer_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`parked retry --all` while the handler still fails reported 1,341 sent for
    1,200 parked: rows parked again during the run were taken again."""
    bodies = [f"raise:{i}".encode() for i in range(40)]
    publish(topology, [(f"p-{i}", b) for i, b in enumerate(bodies)])
    monkeypatch.setattr(parked, "RETRY_PAGE_ROWS", 4)
    with consumer(tmp_path, consumer_dsn, topology, max_attempts=1, prefetch=1):
        wait_settled(consumer_dsn, topology, bodies, 30)
        store = ParkedStore(consumer_dsn, INBOX)
        try:
            sent = parked.retry(store, topology.amqp_url, None)
        finally:
            store.close()
        assert sorted(sent) == sorted(f"p-{i}" for i in range(40))
        wait_for(lambda: len(parked_bodies(consumer_dsn)) == 40, 30, "the 40 to be parked again")


def test_retry__sends_back_exactly_what_arrived(
    topology: Topology, consumer_dsn: str, tmp_path: Path
) -> None:
    """A bytes header came back as str after park and retry."""
    headers = {
        "bin": b"\x00\x01",
        "text": "t\x00ext",
        "nested": {"list": [1, b"\xff", "s", {"deep": b"\x00"}], "flag": True},
        "neg": -5,
        "big": 2**40,
    }
    sent_properties = {
        "content_type": "application/x-thing",
        "content_encoding": "gzip",
        "correlation_id": "corr-1",
        "reply_to": "replies",
        "type": "order.created",
        "app_id": "shop",
        "priority": 3,
        "timestamp": 1_700_000_000,
    }
    publish(topology, [(b"\xff\xfe-bad", b"raise:exact")], headers=headers, **sent_properties)
    with consumer(tmp_path, consumer_dsn, topology, max_attempts=1):
        wait_settled(consumer_dsn, topology, [b"raise:exact"], 30)
    assert scalar(consumer_dsn, f"SELECT count(*) FROM {INBOX}_parked") == 1
    env = {
        **os.environ,
        "OUTBOX_DSN": consumer_dsn,
        "OUTBOX_AMQP_URL": topology.amqp_url,
        "OUTBOX_INBOX_TABLE": INBOX,
    }
    done = subprocess.run(
        [sys.executable, "-m", "outbox", "parked", "retry", "--all"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "1 parked messages sent back" in done.stdout
    (_method, props, body), *rest = topology.messages()
    assert rest == []
    assert body == b"raise:exact"
    assert isinstance(props, pika.BasicProperties)
    received = dict(props.headers)
    assert received.pop("x-outbox-original-exchange") == ""
    assert received.pop("x-outbox-original-routing-key") == topology.queue
    assert received == headers
    assert type(received["bin"]) is bytes
    assert props.message_id == b"\xff\xfe-bad"
    for name, value in sent_properties.items():
        assert getattr(props, name) == value, name
    assert props.delivery_mode == 2


# ``parked retry`` in a process of its own whose peak RSS its parent reports.
PEAK_RSS = r"""
import resource, subprocess, sys
done = subprocess.run(sys.argv[1:])
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
sys.exit(done.returncode)
"""
MB = 1024 * 1024


def peak_rss(
    command: list[str], env: dict[str, str]
) -> tuple[int, subprocess.CompletedProcess[str]]:
    done = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, *command],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return int(done.stdout.strip().splitlines()[-1]), done


def test_retry__holds_a_budget_of_bodies_in_memory_not_every_parked_one(
    topology: Topology, consumer_dsn: str
) -> None:
    """Issue 31, item 5: 8 x 50 MB parked took 1.44 GB at its peak (up to 500 rows
    read at once).  Scaled down: 8 x 20 MB with a budget of 32 MB stays within a few
    bodies of what the same process takes to retry one small message."""
    store = InboxStore(consumer_dsn, INBOX, "c")
    try:
        store.ensure_schema()  # as a consumer does at start-up
    finally:
        store.close()
    with psycopg.connect(consumer_dsn) as conn:
        conn.execute(
            f"INSERT INTO {INBOX}_parked (consumer, message_id, queue, exchange, routing_key,"
            " body, headers, properties, error, attempts)"
            " SELECT 'c', 'small', %(queue)s, '', %(queue)s, 'x', '{}', '{}', 'e', 1",
            {"queue": topology.queue},
        )
    env = {
        **os.environ,
        "OUTBOX_DSN": consumer_dsn,
        "OUTBOX_AMQP_URL": topology.amqp_url,
        "OUTBOX_INBOX_TABLE": INBOX,
        "OUTBOX_BATCH_MAX_BYTES": str(32 * MB),
    }
    retry = [sys.executable, "-m", "outbox", "parked", "retry", "--all"]
    baseline, done = peak_rss(retry, env)
    assert done.returncode == 0, done.stderr
    with psycopg.connect(consumer_dsn) as conn:
        conn.execute(
            f"INSERT INTO {INBOX}_parked (consumer, message_id, queue, exchange, routing_key,"
            " body, headers, properties, error, attempts)"
            " SELECT 'c', 'big-' || i, %(queue)s, '', %(queue)s,"
            "  convert_to(repeat(chr(65 + i), %(size)s), 'SQL_ASCII'), '{}', '{}', 'e', 1"
            " FROM generate_series(1, 8) AS i",
            {"queue": topology.queue, "size": 20 * MB},
        )
    peak, done = peak_rss(retry, env)
    assert done.returncode == 0, done.stderr
    assert "8 parked messages sent back" in done.stdout
    print(f"peak RSS: {peak / MB:.0f} MB retrying 8 x 20 MB, {baseline / MB:.0f} MB one small")
    assert peak - baseline < 5 * 20 * MB, (peak / MB, baseline / MB)
    assert scalar(consumer_dsn, f"SELECT count(*) FROM {INBOX}_parked") == 0
