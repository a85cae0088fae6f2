"""A consumer's start or reconnect takes no lock that others wait on (issue 41,
finding 3).

``ensure_schema`` ran ``CREATE INDEX IF NOT EXISTS`` at every start, which takes a
SHARE lock on the inbox table even when the index exists: behind another consumer's
open handler transaction it waited (5 s, then exit 6), and every other consumer's
INSERT queued behind it.  Now a start looks in the catalog and runs no DDL when the
schema is whole; a missing piece waits in short, logged attempts.

Every consumer here is ``outbox consume`` in a subprocess, all on the default-style
shared inbox table (``support.INBOX``) and each on its own queue.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pika
import psycopg
import pytest

from tests.fixtures.faults import wait_for
from tests.fixtures.servers import Topology
from tests.integration.inbox.support import (
    INBOX,
    Consumer,
    consumer,
    publish,
    rows,
    scalar,
)

# B's handler: longer than the whole test, which kills B at its end.
LONG_HANDLER = "60"
# Messages/s that consumer C applies meanwhile.
C_RATE = 40


@pytest.fixture
def queues(topology: Topology) -> Iterator[tuple[Topology, Topology, Topology]]:
    """Three queues: A's (the test's own), B's and C's."""
    extra = []
    for name in ("b", "c"):
        suffix = f"{name}.{uuid.uuid4().hex[:8]}"
        extra.append(
            dataclasses.replace(
                topology,
                exchange=f"test.ex.{suffix}",
                queue=f"test.q.{suffix}",
                ledger=f"test.ledger.{suffix}",
            )
        )
    for topo in extra:
        topo.declare()
    yield topology, extra[0], extra[1]
    for topo in extra:
        topo.delete()


def in_long_transaction(dsn: str, older_than: float = 1.0) -> int | None:
    """The pid of a consumer session idle in a transaction older than ``older_than``
    seconds (a handler mid-transaction), if there is one."""
    found = rows(
        dsn,
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND application_name LIKE 'outbox-consume%%' AND state = 'idle in transaction' "
        "AND now() - xact_start > make_interval(secs => %s)",
        [older_than],
    )
    return int(found[0][0]) if found else None


def long_handler(
    folder: Path, dsn: str, queue: Topology, before: Callable[[], object] = lambda: None
) -> tuple[Consumer, int]:
    """Consumer B, inside a handler that sleeps ``LONG_HANDLER`` seconds after its
    INSERT (its transaction holds a lock on the inbox table meanwhile); ``before``
    runs once B has started, before its message is sent."""
    (folder / "b").mkdir(exist_ok=True)
    b = Consumer(folder / "b", dsn, queue, env={"HANDLER_SLEEP": LONG_HANDLER}).started()
    before()
    publish(queue, [("b-long", b"sleep:b")])
    pid = wait_for(lambda: in_long_transaction(dsn), 20, "B's handler to be mid-transaction")
    return b, pid


class Steady:
    """Publishes ``C_RATE`` messages a second to a queue until stopped."""

    def __init__(self, queue: Topology) -> None:
        self.queue, self.sent, self.stop = queue, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        channel = pika.BlockingConnection(pika.URLParameters(self.queue.amqp_url)).channel()
        channel.confirm_delivery()
        started = time.monotonic()
        while not self.stop.is_set():
            props = pika.BasicProperties(delivery_mode=2, message_id=f"c-{self.sent}")
            channel.basic_publish("", self.queue.queue, f"ok:c-{self.sent}".encode(), props)
            self.sent += 1
            self.stop.wait(max(0.0, started + self.sent / C_RATE - time.monotonic()))
        channel.connection.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def applied(dsn: str, body: bytes) -> bool:
    return bool(scalar(dsn, "SELECT count(*) FROM effects WHERE body = %s", [body]))


def longest_gap(dsn: str, since: float) -> float:
    """The longest pause (seconds) between two of C's effects committed after
    ``since`` (epoch seconds)."""
    times = [
        float(r[0])
        for r in rows(
            dsn,
            "SELECT extract(epoch FROM at) FROM effects WHERE body LIKE 'ok:c-%%' "
            "AND at >= to_timestamp(%s) ORDER BY at",
            [since],
        )
    ]
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def test_consumer__starts_beside_a_long_handler_without_waiting_or_stalling_others(
    queues: tuple[Topology, Topology, Topology], consumer_dsn: str, tmp_path: Path
) -> None:
    """B is inside a long handler transaction on the shared inbox table; C applies
    40 msg/s.  A, started and restarted three times, applies its first message
    within 10 s each time, and C never pauses longer than 2.5 s (before: A exited
    6 at start-up after a 5 s lock wait, and C paused 5 s at each start of A)."""
    qa, qb, qc = queues
    (tmp_path / "c").mkdir()
    (tmp_path / "a").mkdir()
    firsts: list[float | None] = []
    exits: list[int | None] = []
    output = ""
    steady = Steady(qc)
    try:
        with consumer(tmp_path / "c", consumer_dsn, qc, prefetch=20):
            wait_for(lambda: applied(consumer_dsn, b"ok:c-10"), 20, "C to be applying")
            b, b_pid = long_handler(tmp_path, consumer_dsn, qb)
            try:
                since = time.time()
                for run in range(3):
                    body = f"ok:a-{run}".encode()
                    publish(qa, [(f"a-{run}", body)])
                    started = time.monotonic()
                    a = Consumer(tmp_path / "a", consumer_dsn, qa)
                    try:
                        deadline = started + 10
                        while time.monotonic() < deadline and a.alive():
                            if applied(consumer_dsn, body):
                                break
                            time.sleep(0.05)
                        done = applied(consumer_dsn, body)
                        firsts.append(time.monotonic() - started if done else None)
                        exits.append(a.terminate() if a.alive() else a.process.returncode)
                        output = a.output()
                    finally:
                        a.close()
                gap = longest_gap(consumer_dsn, since)
                # B stayed inside its handler the whole time.
                assert in_long_transaction(consumer_dsn) == b_pid
            finally:
                b.close()
    finally:
        steady.close()
    print(f"A's first effect after (s): {firsts}; exits {exits}; C's longest pause {gap:.2f} s")
    assert all(f is not None and f < 10 for f in firsts), (firsts, exits, output[-2000:])
    assert exits == [0, 0, 0], output[-2000:]
    assert gap < 2.5, f"C paused {gap:.2f} s"


def drop_index(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute(f"DROP INDEX {INBOX}_by_age")


def index_exists(dsn: str) -> bool:
    return bool(scalar(dsn, "SELECT to_regclass(%s) IS NOT NULL", [f"{INBOX}_by_age"]))


def test_consumer__makes_a_missing_index_and_waits_for_a_busy_table_instead_of_exiting(
    queues: tuple[Topology, Topology, Topology], consumer_dsn: str, tmp_path: Path
) -> None:
    """The inbox's index dropped: a consumer start makes it again.  Dropped again,
    with B inside a long handler on the table: A does not exit (before: exit 6
    after one 5 s wait); it logs that it waits, on B's session, tries again, and
    makes the index and applies its message once B's transaction is gone."""
    qa, qb, _qc = queues
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with consumer(tmp_path / "b", consumer_dsn, qb):
        pass  # the tables, made by a first consumer
    drop_index(consumer_dsn)
    publish(qa, [("a-0", b"ok:a-0")])
    with consumer(tmp_path / "a", consumer_dsn, qa):
        wait_for(lambda: applied(consumer_dsn, b"ok:a-0"), 20, "A's first message")
    assert index_exists(consumer_dsn)

    # Dropped once B has started (B would make it), before B's handler holds the table.
    b, b_pid = long_handler(tmp_path, consumer_dsn, qb, lambda: drop_index(consumer_dsn))
    publish(qa, [("a-1", b"ok:a-1")])
    a = Consumer(tmp_path / "a", consumer_dsn, qa)
    try:
        try:
            wait_for(
                lambda: a.output().count("consumer.schema_waiting") >= 2 or not a.alive(),
                30,
                "A to say that it waits",
            )
            assert a.alive(), a.output()[-3000:]
            line = next(x for x in a.output().splitlines() if "consumer.schema_waiting" in x)
            print(line)
            assert "create_inbox_by_age" in line and f"session pid {b_pid}" in line, line
            assert not index_exists(consumer_dsn) and not applied(consumer_dsn, b"ok:a-1")
        finally:
            b.close()  # B's transaction ends with its session
        wait_for(lambda: applied(consumer_dsn, b"ok:a-1"), 20, "A's message, once B is gone")
        assert index_exists(consumer_dsn)
        assert a.terminate() == 0, a.output()[-3000:]
    finally:
        a.close()
