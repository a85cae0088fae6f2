"""Custody: on a quorum queue with a delivery limit, the consumer stores what the
broker returned before the broker can drop it (``outbox.inbox.custody``).

Every consumer death returns every message it held and counts a delivery against
each; past the limit the broker drops them.  Before custody, a crash loop (kill -9
every 1-2 s, limit 2, 1,500 messages, a 20 ms handler) applied 1,222, parked 2 and
lost 276, and a message at its last delivery whose handler failed once was lost on
a clean stop.  Each test here runs ``outbox consume`` as a user does and kills it
with SIGKILL.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.servers import Topology
from tests.integration.inbox.support import (
    INBOX,
    Consumer,
    effect_bodies,
    parked_bodies,
    publish,
    queue_depth,
    rows,
    scalar,
)
from tests.integration.inbox.test_queue_policies import redeclare


def publish_keyed(topology: Topology, count: int, keys: int) -> list[bytes]:
    """``count`` healthy messages over ``keys`` ordering keys, in order; each body
    names its key and its place (``slow:K3:000042``)."""
    bodies = [f"slow:K{i % keys}:{i:06d}".encode() for i in range(count)]
    for i in range(keys):
        key_bodies = [b for b in bodies if b.split(b":")[1] == f"K{i}".encode()]
        publish(
            topology,
            [(str(uuid.uuid4()), b) for b in key_bodies],
            headers={"x-ordering-key": f"K{i}"},
        )
    return bodies


def settled(dsn: str, bodies: list[bytes], topology: Topology) -> bool:
    done = set(effect_bodies(dsn))
    tables = scalar(dsn, "SELECT to_regclass(%s) IS NOT NULL", [f"{INBOX}_parked"])
    if tables:
        done |= set(parked_bodies(dsn))
    return set(bodies) <= done and queue_depth(topology) == 0


@pytest.mark.parametrize(
    ("limit", "function", "seed"),
    [(2, "act", 1), (2, "act_async", 2), (20, "act", 3)],
    ids=["limit2-plain", "limit2-async", "limit20-plain"],
)
def test_custody__a_crash_loop_on_a_quorum_queue_with_a_delivery_limit_loses_nothing(
    tmp_path: Path, consumer_dsn: str, topology: Topology, limit: int, function: str, seed: int
) -> None:
    """600 healthy messages over 10 ordering keys, a 10 ms handler, prefetch 200,
    the consumer killed with SIGKILL eight times at random moments 0.4-1.4 s apart
    and restarted at once.  Every message is applied exactly once, none is parked
    or lost, and each key's messages are applied in the order they were published.
    The broker's limit is spent by the kills (limit 2: every message returned
    twice would be dropped without custody; on the code before custody 260-280 of
    the 600 were lost).  ``CUSTODY_MESSAGES``, ``CUSTODY_HANDLER_SECONDS`` and
    ``CUSTODY_KILL_GAP`` (``0.4-1.4``) change the shape; ``pytest -s`` prints the
    figures."""
    redeclare(topology, {"x-queue-type": "quorum", "x-delivery-limit": limit})
    rng = random.Random(seed)
    # Eight kills for this run: the last one before the queue drains.  The
    # variables give the shape of a longer run (1,500 messages, 20 ms, 1-2 s).
    low, high = (float(v) for v in os.environ.get("CUSTODY_KILL_GAP", "0.4-1.4").split("-"))
    pauses = [rng.uniform(low, high) for _ in range(8)]
    options: dict[str, Any] = {
        "function": function,
        "max_attempts": 5,
        "prefetch": 200,
        "env": {"OK_SLOW": os.environ.get("CUSTODY_HANDLER_SECONDS", "0.01")},
    }
    count = int(os.environ.get("CUSTODY_MESSAGES", "600"))
    bodies = publish_keyed(topology, count, 10)
    started = time.monotonic()
    process = Consumer(tmp_path, consumer_dsn, topology, **options)
    kills, deadline = 0, time.monotonic() + 120
    try:
        for pause in pauses:
            process.started()
            time.sleep(pause)
            process.kill()
            kills += 1
            process.close()
            process = Consumer(tmp_path, consumer_dsn, topology, **options)
        while not settled(consumer_dsn, bodies, topology):
            assert process.alive(), process.output()[-3000:]
            assert time.monotonic() < deadline, (
                f"not settled: {len(set(effect_bodies(consumer_dsn)))} of {len(bodies)}\n"
                + process.output()[-3000:]
            )
            time.sleep(0.2)
        assert process.terminate() == 0, process.output()[-3000:]
    finally:
        process.close()
    effects = rows(consumer_dsn, "SELECT body FROM effects ORDER BY n")
    applied = [bytes(b) for (b,) in effects]
    assert sorted(applied) == sorted(bodies)  # nothing lost, nothing applied twice
    assert parked_bodies(consumer_dsn) == []
    by_key: dict[bytes, list[bytes]] = defaultdict(list)
    for body in applied:
        by_key[body.split(b":")[1]].append(body)
    for key, seen in by_key.items():
        assert seen == sorted(seen), f"key {key!r} applied out of order"
    left = scalar(consumer_dsn, f"SELECT count(*) FROM {INBOX}_custody")
    assert left == 0  # custody drained
    assert kills == 8
    print(
        f"\ncustody crash loop: limit {limit}, {function}, {len(bodies)} published, "
        f"{len(applied)} applied, {len(parked_bodies(consumer_dsn))} parked, "
        f"{len(set(bodies) - set(applied))} lost, {kills} kills, "
        f"{time.monotonic() - started:.1f} s"
    )


def test_custody__a_failure_at_the_last_delivery_survives_a_clean_stop(
    tmp_path: Path, consumer_dsn: str, topology: Topology
) -> None:
    """x-delivery-limit 1.  The message's handler kills the consumer (its first
    death: the broker returns it, at its last delivery), then raises once, and the
    consumer is stopped with SIGTERM while the message waits for its retry.
    Before: the message went back to the broker on the stop and was dropped (2
    published, 1 applied, 0 parked, 1 lost).  Now it waits in custody through the
    stop, and the next consumer applies it."""
    redeclare(topology, {"x-queue-type": "quorum", "x-delivery-limit": 1})
    bodies = [b"die:once", b"ok:1"]
    publish(topology, [(str(uuid.uuid4()), b) for b in bodies])
    first = Consumer(tmp_path, consumer_dsn, topology, max_attempts=5)
    try:
        first.process.wait(timeout=30)  # the handler killed it
    finally:
        first.close()
    # The retry waits 5 s: long enough for the stop to come first; it waits in
    # custody through the stop, so the next consumer applies it once it is due.
    slow = {"HANDLER_RAISES": "1", "OUTBOX_RETRY_DELAY": "5", "OUTBOX_RETRY_DELAY_MAX": "5"}
    second = Consumer(tmp_path, consumer_dsn, topology, max_attempts=5, env=slow)
    try:
        second.started()
        deadline = time.monotonic() + 15
        while "consumer.handler_failed" not in second.output() and time.monotonic() < deadline:
            assert second.alive(), second.output()[-3000:]
            time.sleep(0.1)
        assert second.terminate() == 0, second.output()[-3000:]
    finally:
        second.close()
    assert queue_depth(topology) == 0  # the broker holds nothing of it
    # It waits in custody for its retry delay (15-30 s with the jitter), which the
    # third consumer need not wait out: the delay is made over.
    waiting = f"UPDATE {INBOX}_custody SET not_before = now() RETURNING body"
    assert [bytes(b) for (b,) in rows(consumer_dsn, waiting)] == [b"die:once"]
    third = Consumer(tmp_path, consumer_dsn, topology, max_attempts=5, env={"HANDLER_FIXED": "1"})
    try:
        third.started()
        deadline = time.monotonic() + 30
        while sorted(effect_bodies(consumer_dsn)) != sorted(bodies) and time.monotonic() < deadline:
            assert third.alive(), third.output()[-3000:]
            time.sleep(0.1)
        assert third.terminate() == 0, third.output()[-3000:]
    finally:
        third.close()
    assert sorted(effect_bodies(consumer_dsn)) == sorted(bodies)
    assert parked_bodies(consumer_dsn) == []
