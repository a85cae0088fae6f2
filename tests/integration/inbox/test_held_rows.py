"""A message whose inbox row another transaction holds costs one short wait, not
one lock_timeout per retry (issue 41, finding 4).

Before: each try of the held message waited the session's whole lock_timeout (5 s)
on the consumer's only thread, and it was tried again at once: 2,000 healthy
messages behind one held row were applied 100 per 5 s.  Now the record step waits
``RECORD_LOCK_TIMEOUT`` (0.2 s), the held message is set aside in hand (unacked, no
attempt counted) and tried again after a growing delay, and the others go on.
"""

from __future__ import annotations

import time
from pathlib import Path

import pika
import psycopg
import pytest

from tests.fixtures.faults import wait_for
from tests.fixtures.servers import Topology
from tests.integration.inbox.support import INBOX, consumer, queue_depth, rows

HEALTHY = 2000


def publish_fast(topology: Topology, messages: list[tuple[str, bytes]]) -> None:
    """Persistent messages without waiting for a confirm after each (support.publish
    does, which takes longer than applying them on a loaded machine); a message
    lost would fail the test, never pass it."""
    connection = pika.BlockingConnection(pika.URLParameters(topology.amqp_url))
    channel = connection.channel()
    for message_id, body in messages:
        props = pika.BasicProperties(delivery_mode=2, message_id=message_id)
        channel.basic_publish("", topology.queue, body, props)
    connection.close()


def healthy_applied(dsn: str) -> int:
    return int(
        rows(dsn, "SELECT count(DISTINCT message_id) FROM effects WHERE message_id LIKE 'h-%%'")[0][
            0
        ]
    )


@pytest.mark.parametrize("holder_ends", ["commit", "rollback"])
def test_consumer__a_held_inbox_row_costs_one_short_wait_and_the_others_go_on(
    topology: Topology, consumer_dsn: str, tmp_path: Path, holder_ends: str
) -> None:
    """2,000 healthy messages behind one whose inbox row another session holds: all
    applied within a few seconds while it stays held (before: 100 per 5 s); the
    held one is then skipped (the holder committed its id) or applied (rolled
    back), once, without an attempt counted, a requeue or a reconnect."""
    with (
        consumer(
            tmp_path, consumer_dsn, topology, prefetch=200, env={"OUTBOX_LOG_LEVEL": "info"}
        ) as process,
        psycopg.connect(consumer_dsn) as holder,
    ):
        # As another consumer applying a copy, or an operator's session, would.
        holder.execute(
            f"INSERT INTO {INBOX} (consumer, message_id) VALUES (%s, 'held')", [topology.queue]
        )
        holder.execute("INSERT INTO effects (message_id, body) VALUES ('held', 'by-holder')")
        started = time.monotonic()
        publish_fast(
            topology, [("held", b"ok:held")] + [(f"h-{i}", b"ok:h") for i in range(HEALTHY)]
        )
        while healthy_applied(consumer_dsn) < HEALTHY and time.monotonic() < started + 20:
            time.sleep(0.1)
        took, done = time.monotonic() - started, healthy_applied(consumer_dsn)
        print(f"{done} of {HEALTHY} healthy messages applied in {took:.1f} s, the row held")
        assert done == HEALTHY, f"{done} applied in {took:.1f} s"
        if holder_ends == "commit":
            holder.commit()
        else:
            holder.rollback()
        wait_for(lambda: queue_depth(topology) == 0, 20, "the held message to be settled")
        wait_for(
            lambda: (
                "consumer.message_held" in process.output()
                and (
                    holder_ends == "commit"
                    or rows(consumer_dsn, "SELECT count(*) FROM effects WHERE body = 'ok:held'")
                    == [(1,)]
                )
            ),
            20,
            "the held message's outcome",
        )
        output = process.output()
    held = [line for line in output.splitlines() if "consumer.message_held" in line]
    print(held[0])
    print(f"tried {len(held)} times while held")
    assert "consumer.retry" not in output, output[-3000:]  # no outage, no channel closed
    effects = dict(
        rows(consumer_dsn, "SELECT message_id, count(*) FROM effects GROUP BY message_id")
    )
    assert len(effects) == HEALTHY + 1 and set(effects.values()) == {1}
    bodies = rows(consumer_dsn, "SELECT body FROM effects WHERE message_id = 'held'")
    assert [bytes(b) for (b,) in bodies] == [
        b"by-holder" if holder_ends == "commit" else b"ok:held"
    ]
    assert rows(consumer_dsn, f"SELECT count(*) FROM {INBOX}_attempts") == [(0,)]
    assert rows(consumer_dsn, f"SELECT count(*) FROM {INBOX}_parked") == [(0,)]
