"""Issue 31, items 1 and 2: every delivered message ends in one place whatever the
queue's own policy, and a failing message does not hold the others.

Each test redeclares the test's queue with the policy under test and runs
``outbox consume`` as a user does.  On the code before issue 31 each one lost
messages or waited: a quorum queue's delivery limit dropped a failing message
(and, in a crash loop, the healthy ones returned with it), a TTL expired a
message between its retries, a stream was consumed without a word, and a
``--retry-delay`` held every healthy message behind a failing one.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pika
import pytest

from tests.fixtures.faults import wait_for
from tests.fixtures.servers import Topology
from tests.integration.inbox.support import (
    INBOX,
    Consumer,
    consumer,
    effect_bodies,
    parked_bodies,
    publish,
    queue_depth,
    rows,
    scalar,
    wait_settled,
)


def redeclare(topology: Topology, arguments: dict[str, Any]) -> None:
    """The test's queue again, with ``arguments``, bound as before."""
    ch = topology.channel()
    ch.queue_delete(topology.queue)
    ch.queue_declare(topology.queue, durable=True, arguments=arguments)
    ch.queue_bind(topology.queue, topology.exchange, "#")
    ch.connection.close()


def ids(count: int) -> list[str]:
    return [str(uuid.uuid4()) for _ in range(count)]


@pytest.mark.parametrize("limit", [2, 3])
def test_policy__a_quorum_delivery_limit_below_max_attempts_still_parks_the_failing_message(
    tmp_path: Path, consumer_dsn: str, topology: Topology, limit: int
) -> None:
    """x-delivery-limit 2 or 3 and --max-attempts 5: the failing message is tried 5
    times (held in hand between attempts, never returned) and parked; before, the
    broker dropped it after limit + 1 attempts."""
    redeclare(topology, {"x-queue-type": "quorum", "x-delivery-limit": limit})
    good = [f"ok:{i}".encode() for i in range(3)]
    bodies = [b"raise:always", *good]
    publish(topology, list(zip(ids(4), bodies, strict=True)))
    with consumer(tmp_path, consumer_dsn, topology, max_attempts=5) as process:
        wait_settled(consumer_dsn, topology, bodies, timeout=20)
        assert f"x-delivery-limit {limit}" in process.output()
    assert sorted(effect_bodies(consumer_dsn)) == sorted(good)
    assert rows(consumer_dsn, f"SELECT body, attempts FROM {INBOX}_parked") == [
        (b"raise:always", 5)
    ]


@pytest.mark.parametrize("single_active", [False, True], ids=["", "single_active_consumer"])
def test_policy__a_crash_loop_on_a_quorum_queue_loses_no_healthy_message(
    tmp_path: Path, consumer_dsn: str, topology: Topology, single_active: bool
) -> None:
    """x-delivery-limit 3, --max-attempts 5, the 4th of 10 messages kills the
    consumer (os._exit).  Each death returns every unacked message and counts a
    delivery against each; a returned message is taken into custody (stored and
    acked) before any handler runs, so the killer gets its --max-attempts counted
    deaths past the broker's limit and is parked, and nothing else is lost.  Before
    issue 31: 10 published, 4 effects, 0 parked, 6 lost.  Also with
    x-single-active-consumer (the ordered set-up), whose boolean the consumer
    could not read back, so it knew none of the queue's arguments (4 effects)."""
    arguments: dict[str, Any] = {"x-queue-type": "quorum", "x-delivery-limit": 3}
    if single_active:
        arguments["x-single-active-consumer"] = True
    redeclare(topology, arguments)
    bodies = [b"die:now" if i == 3 else f"ok:{i}".encode() for i in range(10)]
    publish(topology, list(zip(ids(10), bodies, strict=True)))
    deaths, deadline = 0, time.monotonic() + 60
    process = Consumer(tmp_path, consumer_dsn, topology, max_attempts=5, prefetch=10)
    try:
        while True:
            if not process.alive():
                assert process.process.returncode == 1, process.output()[-3000:]
                deaths += 1
                # The first death is in a batch (not counted), then 5 counted ones.
                assert deaths <= 6, f"the killer loops:\n{process.output()[-3000:]}"
                process.close()
                process = Consumer(tmp_path, consumer_dsn, topology, max_attempts=5, prefetch=10)
            tables = scalar(consumer_dsn, "SELECT to_regclass(%s) IS NOT NULL", [f"{INBOX}_parked"])
            settled = set(effect_bodies(consumer_dsn)) | set(
                parked_bodies(consumer_dsn) if tables else []
            )
            if set(bodies) <= settled and queue_depth(topology) == 0:
                break
            assert time.monotonic() < deadline, (
                f"not settled after {deaths} deaths: {sorted(settled)}\n{process.output()[-3000:]}"
            )
            time.sleep(0.05)
        assert process.terminate() == 0, process.output()[-3000:]
    finally:
        process.close()
    effects = effect_bodies(consumer_dsn)
    assert sorted(effects) == sorted(b for b in bodies if b != b"die:now")  # each once
    assert parked_bodies(consumer_dsn) == [b"die:now"]
    assert deaths >= 5  # past the broker's limit: the killer was in custody


@pytest.mark.parametrize("ttl", ["expiration", "x-message-ttl"])
def test_policy__a_failing_message_with_a_ttl_is_parked_not_dead_lettered(
    tmp_path: Path, consumer_dsn: str, topology: Topology, ttl: str
) -> None:
    """A TTL of 300 ms and a retry delay of 0.5 s, with a dead-letter exchange:
    before, the message went back to the queue between attempts, expired there
    and was dead-lettered, never parked.  Now it waits in the consumer's hands,
    where no TTL runs."""
    dead = f"{topology.queue}.dead"
    ch = topology.channel()
    ch.queue_declare(dead, durable=True)
    ch.connection.close()
    arguments: dict[str, Any] = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dead}
    properties: dict[str, Any] = {}
    if ttl == "x-message-ttl":
        arguments["x-message-ttl"] = 300
    else:
        properties["expiration"] = "300"
    redeclare(topology, arguments)
    try:
        env = {"OUTBOX_RETRY_DELAY": "0.5", "OUTBOX_RETRY_DELAY_MAX": "0.5"}
        with consumer(tmp_path, consumer_dsn, topology, max_attempts=3, env=env):
            # Published once the consumer runs: a TTL of 300 ms is shorter than its start.
            publish(topology, [(ids(1)[0], b"raise:always"), (ids(1)[0], b"ok:1")], **properties)
            wait_settled(consumer_dsn, topology, [b"raise:always", b"ok:1"], timeout=15)
        ch = topology.channel()
        dead_letters = ch.queue_declare(dead, passive=True).method.message_count
        ch.connection.close()
    finally:
        ch = topology.channel()
        ch.queue_delete(dead)
        ch.connection.close()
    assert dead_letters == 0
    assert parked_bodies(consumer_dsn) == [b"raise:always"]
    assert effect_bodies(consumer_dsn) == [b"ok:1"]


def test_policy__a_stream_is_refused_at_start_with_one_line_and_exit_2(
    tmp_path: Path, consumer_dsn: str, topology: Topology
) -> None:
    """A stream refuses requeues and starts a new consumer at its end: before, it
    was consumed without a word (12 published, 3 applied, 9 lost)."""
    redeclare(topology, {"x-queue-type": "stream"})
    process = Consumer(tmp_path, consumer_dsn, topology)
    try:
        wait_for(lambda: not process.alive(), 20, "the consumer to refuse the stream")
        output = process.output()
    finally:
        process.close()
    assert process.process.returncode == 2, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "stream" in errors[0], output[-3000:]
    assert "Traceback" not in output


def test_retry__a_long_retry_delay_does_not_hold_the_healthy_messages(
    tmp_path: Path, consumer_dsn: str, topology: Topology
) -> None:
    """--retry-delay 20: the failing message waits 20 s for its next attempt, the
    five healthy ones behind it are applied at once (before: 18.9 s later)."""
    good = [f"ok:{i}".encode() for i in range(5)]
    env = {"OUTBOX_RETRY_DELAY": "20", "OUTBOX_RETRY_DELAY_MAX": "20"}
    with consumer(tmp_path, consumer_dsn, topology, max_attempts=3, env=env):
        started = time.monotonic()
        publish(topology, [(ids(1)[0], b"raise:always")])
        publish(topology, list(zip(ids(5), good, strict=True)))
        wait_for(lambda: len(effect_bodies(consumer_dsn)) == 5, 15, "the healthy messages")
        waited = time.monotonic() - started
    assert waited < 10, waited
    assert sorted(effect_bodies(consumer_dsn)) == sorted(good)


def test_retry__a_failing_keyed_message_holds_its_own_key_only(
    tmp_path: Path, consumer_dsn: str, topology: Topology
) -> None:
    """Key A: a failing message, then a good one; key B: a good one.  B is applied
    at once; A's good message waits until A's failing one is settled (parked at
    --max-attempts 2), then is applied: A keeps its order."""
    env = {"OUTBOX_RETRY_DELAY": "1.5", "OUTBOX_RETRY_DELAY_MAX": "1.5"}
    ch = topology.channel()
    ch.confirm_delivery()
    for key, body in [("A", b"raise:a1"), ("A", b"ok:a2"), ("B", b"ok:b1")]:
        properties = pika.BasicProperties(
            delivery_mode=2, message_id=ids(1)[0], headers={"x-ordering-key": key}
        )
        ch.basic_publish("", topology.queue, body, properties)
    ch.connection.close()
    with consumer(tmp_path, consumer_dsn, topology, max_attempts=2, env=env):
        wait_for(lambda: b"ok:b1" in effect_bodies(consumer_dsn), 10, "key B")
        assert b"ok:a2" not in effect_bodies(consumer_dsn)  # behind a1
        wait_settled(consumer_dsn, topology, [b"raise:a1", b"ok:a2", b"ok:b1"], timeout=15)
    assert parked_bodies(consumer_dsn) == [b"raise:a1"]
    parked_at = rows(consumer_dsn, f"SELECT parked_at FROM {INBOX}_parked")[0][0]
    applied_at = rows(consumer_dsn, "SELECT at FROM effects WHERE body = 'ok:a2'")[0][0]
    assert applied_at >= parked_at


def test_retry__more_failing_messages_than_the_prefetch_do_not_hold_the_healthy_ones(
    tmp_path: Path, consumer_dsn: str, topology: Topology
) -> None:
    """--prefetch 4 and 6 failing messages (a downstream outage for some keys, say),
    each waiting 20 s for its next attempt, then 5 healthy ones: the failing ones held
    in hand must not take every unacked slot the broker allows, or the healthy
    messages behind them would wait for the retries."""
    good = [f"ok:{i}".encode() for i in range(5)]
    env = {"OUTBOX_RETRY_DELAY": "20", "OUTBOX_RETRY_DELAY_MAX": "20", "OUTBOX_PREFETCH": "4"}
    with consumer(tmp_path, consumer_dsn, topology, max_attempts=3, env=env):
        started = time.monotonic()
        publish(topology, [(i, b"raise:always") for i in ids(6)])
        publish(topology, list(zip(ids(5), good, strict=True)))
        wait_for(lambda: len(effect_bodies(consumer_dsn)) == 5, 15, "the healthy messages")
        waited = time.monotonic() - started
    assert waited < 10, waited
    assert sorted(effect_bodies(consumer_dsn)) == sorted(good)
