"""A message whose handler kills the consumer process (``os._exit``, SIGKILL: what
a segfault or the OOM killer does) ends parked, with the reason, and never loops:
``outbox consume`` processes restarted after each death as a supervisor would,
until the queue drains.  Every other message has exactly one effect, none is lost.

Redelivered messages are applied alone with their attempt committed before the
handler is called, so only the killer accumulates attempts, also when it sits in
the middle of a batch of 100 (``outbox/inbox/steps.py``, ``Processor.alone``).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox.amqp.message import InboxMessage
from outbox.db.inbox import InboxStore, ParkedStore
from outbox.errors import DatabaseUnavailable
from outbox.inbox import parked
from outbox.inbox.planning import Disposition
from outbox.inbox.settings import ConsumerSettings
from outbox.inbox.stats import ConsumerStats
from outbox.inbox.steps import Processor
from tests.fixtures.faults import TcpProxy, proxied_dsn
from tests.fixtures.servers import Topology
from tests.integration.inbox.support import (
    INBOX,
    Consumer,
    parked_bodies,
    publish,
    queue_depth,
    rows,
    scalar,
)

MAX_ATTEMPTS = 3


def supervise(
    folder: Path,
    dsn: str,
    topology: Topology,
    expected: set[bytes],
    *,
    prefetch: int,
    env: dict[str, str] | None = None,
) -> tuple[int, str]:
    """Run one consumer, restarted after each death, until every body in
    ``expected`` has an effect or is parked and the queue is empty; returns the
    deaths and the last consumer's output.  Fails when the killer loops (more
    deaths than it may cost) or after a timeout."""
    deaths, deadline = 0, time.monotonic() + 120
    process = Consumer(folder, dsn, topology, max_attempts=MAX_ATTEMPTS, prefetch=prefetch, env=env)
    try:
        while True:
            if not process.alive():
                assert process.process.returncode in (1, -9), process.output()[-3000:]
                deaths += 1
                assert deaths <= MAX_ATTEMPTS + 1, f"the killer loops:\n{process.output()[-3000:]}"
                process.close()
                process = Consumer(
                    folder, dsn, topology, max_attempts=MAX_ATTEMPTS, prefetch=prefetch, env=env
                )
            done = {bytes(r[0]) for r in rows(dsn, "SELECT body FROM effects")}
            started = scalar(dsn, "SELECT to_regclass(%s) IS NOT NULL", [f"{INBOX}_parked"])
            if (
                started
                and expected <= done | set(parked_bodies(dsn))
                and queue_depth(topology) == 0
            ):
                break
            assert time.monotonic() < deadline, f"not settled; {deaths} deaths"
            time.sleep(0.05)
        time.sleep(0.5)  # whatever the last one holds is settled
        assert process.alive(), process.output()[-3000:]
        assert process.terminate() == 0, process.output()[-3000:]
        return deaths, process.output()
    finally:
        process.close()


@pytest.mark.parametrize("how", ["die", "sigkill"])
@pytest.mark.parametrize(("count", "at", "prefetch"), [(30, 10, 4), (100, 37, 200)])
def test_killer__parked_after_max_attempts_counted_deaths_the_others_applied_once(
    topology: Topology,
    consumer_dsn: str,
    tmp_path: Path,
    how: str,
    count: int,
    at: int,
    prefetch: int,
) -> None:
    """(30, 10, 4): small batches, the killer among them; (100, 37, 200): one batch
    of 100 (half of --prefetch 200) with the killer 37th: it comes back whole,
    redelivered, and only the killer is parked."""
    messages = [
        (f"m{i}", f"{how}:{i}".encode() if i == at else f"ok:{i}".encode()) for i in range(count)
    ]
    publish(topology, messages)
    deaths, output = supervise(
        tmp_path, consumer_dsn, topology, {b for _, b in messages}, prefetch=prefetch
    )
    # The first death comes in a batch (nothing is counted there); each later one
    # was counted before its handler call: parked on the next redelivery, unseen.
    assert deaths == MAX_ATTEMPTS + 1
    parked = rows(consumer_dsn, f"SELECT message_id, error, attempts FROM {INBOX}_parked")
    assert len(parked) == 1
    message_id, error, attempts = parked[0]
    assert message_id == f"m{at}" and attempts == MAX_ATTEMPTS
    assert error.startswith(
        f"redelivered {MAX_ATTEMPTS} times, the outcome of the last attempt unknown"
    ), error
    assert "os._exit" in error
    effects = collections.Counter(
        r[0] for r in rows(consumer_dsn, "SELECT message_id FROM effects")
    )
    assert effects == {f"m{i}": 1 for i in range(count) if i != at}
    assert scalar(consumer_dsn, f"SELECT count(*) FROM {INBOX}") == count
    assert scalar(consumer_dsn, f"SELECT count(*) FROM {INBOX}_attempts") == 0
    assert queue_depth(topology) == 0 and topology.messages() == []
    assert "outcome of the last attempt unknown" in output  # parked by the last consumer


def test_killer__a_retried_killer_starts_counting_afresh(
    topology: Topology, consumer_dsn: str, tmp_path: Path
) -> None:
    """``outbox parked retry`` removes the parked row, the id and the count; the
    message comes back as a new delivery (not redelivered): it takes the batch
    path, is parked again only after as many deaths as the first time, and is
    applied once the handler is fixed."""
    publish(topology, [("k", b"die:k"), ("g", b"ok:g")])
    expected = {b"die:k", b"ok:g"}
    assert supervise(tmp_path, consumer_dsn, topology, expected, prefetch=4)[0] == MAX_ATTEMPTS + 1
    for fixed in (False, True):
        store = ParkedStore(consumer_dsn, INBOX)
        try:
            assert parked.retry(store, topology.amqp_url, None) == ["k"]
        finally:
            store.close()
        assert scalar(consumer_dsn, f"SELECT count(*) FROM {INBOX}_attempts") == 0
        env = {"HANDLER_FIXED": "1"} if fixed else {}
        deaths, _ = supervise(tmp_path, consumer_dsn, topology, expected, prefetch=4, env=env)
        assert deaths == (0 if fixed else MAX_ATTEMPTS + 1)
        assert len(parked_bodies(consumer_dsn)) == (0 if fixed else 1)
    effects = collections.Counter(
        r[0] for r in rows(consumer_dsn, "SELECT message_id FROM effects")
    )
    assert effects == {"k": 1, "g": 1}


def b_waits_for_a(
    a: Processor,
    first: InboxMessage,
    b: Processor,
    copy: InboxMessage,
    in_handler: threading.Event,
    release: threading.Event,
    while_b_waits: Callable[[], None] = lambda: None,
) -> dict[str, Disposition]:
    """a processes ``first`` until its handler sets ``in_handler``; b then processes
    ``copy`` and must still be waiting half a second later; ``release`` lets a's
    handler end.  Returns both dispositions."""
    results: dict[str, Disposition] = {}
    thread = threading.Thread(target=lambda: results.update(a=a.process(first)[0]))
    thread.start()
    assert in_handler.wait(10)
    waiting = threading.Thread(target=lambda: results.update(b=b.process(copy)[0]))
    waiting.start()
    time.sleep(0.5)
    assert waiting.is_alive()
    while_b_waits()
    release.set()
    thread.join(10)
    waiting.join(10)
    return results


# The record lock_timeout of a consumer that must wait for the other's outcome here.
WAIT = 10.0


def race(
    topology: Topology, consumer_dsn: str, *, first_redelivered: bool
) -> tuple[dict[str, Disposition], int]:
    """Consumer a holds a message in its handler (a first delivery, or a redelivered
    copy); consumer b gets a redelivered copy of it meanwhile and must wait.  Returns
    both outcomes and the attempt count while b waited; checks one effect, no count
    left behind."""
    settings = ConsumerSettings(queue=topology.queue, dsn=consumer_dsn, inbox_table=INBOX)
    in_handler, release = threading.Event(), threading.Event()

    def record(conn: psycopg.Connection[object], message: InboxMessage) -> None:
        conn.execute("INSERT INTO effects (message_id) VALUES (%s)", [message.message_id])

    def held(conn: psycopg.Connection[object], message: InboxMessage) -> None:
        record(conn, message)
        in_handler.set()
        assert release.wait(10)

    # b waits for a's outcome (by default it would give up after RECORD_LOCK_TIMEOUT
    # and set the copy aside, uncounted, to try it again later: test_held_rows).
    stores = [
        InboxStore(consumer_dsn, INBOX, settings.consumer, record_lock_timeout=WAIT)
        for _ in range(2)
    ]
    stores[0].ensure_schema()
    try:
        a = Processor(stores[0], held, settings, ConsumerStats())
        b = Processor(stores[1], record, settings, ConsumerStats())
        first = InboxMessage("c", b"x", {}, "ex", "k", None, first_redelivered, topology.queue)
        copy = InboxMessage("c", b"x", {}, "ex", "k", None, True, topology.queue)
        counted: list[int] = []

        def while_b_waits() -> None:
            total = f"SELECT coalesce(sum(attempts), 0) FROM {INBOX}_attempts"
            counted.append(int(scalar(consumer_dsn, total)))

        results = b_waits_for_a(a, first, b, copy, in_handler, release, while_b_waits)
        assert scalar(consumer_dsn, "SELECT count(*) FROM effects") == 1
        assert scalar(consumer_dsn, f"SELECT count(*) FROM {INBOX}_attempts") == 0
        return results, counted[0]
    finally:
        for store in stores:
            store.close()


def test_killer__a_copy_in_another_consumer_waits_for_the_outcome(
    topology: Topology, consumer_dsn: str
) -> None:
    """Two redelivered copies of one message in two consumers at once: the second
    waits on the first's attempt lock (one attempt counted, the first's) and finds
    its id (none left behind)."""
    results, counted = race(topology, consumer_dsn, first_redelivered=True)
    assert results == {"a": Disposition.HANDLED, "b": Disposition.DUPLICATE}
    assert counted == 1


def test_killer__a_redelivered_copy_of_a_message_applied_meanwhile_leaves_no_count(
    topology: Topology, consumer_dsn: str
) -> None:
    """A first delivery of a message in flight in one consumer (its id recorded, not
    committed: the attempt lock is not taken on that path) and a redelivered copy in
    another: the copy's attempt is counted (the id is not visible yet), then its
    transaction waits on the id and finds it: a duplicate, and the count it left goes
    with it."""
    results, _ = race(topology, consumer_dsn, first_redelivered=False)
    assert results == {"a": Disposition.HANDLED, "b": Disposition.DUPLICATE}


def refuse(conn: psycopg.Connection[object], message: InboxMessage) -> None:
    raise RuntimeError("the handler refuses")


@pytest.mark.parametrize("next_copy", ["same process", "another process"])
def test_killer__the_database_lost_before_the_last_attempts_error_is_recorded(
    topology: Topology, consumer_dsn: str, next_copy: str
) -> None:
    """A redelivered message's last attempt is counted, its handler raises, and the
    database goes away before the error is recorded.  The process that saw the
    error records it once the database is back (the message is parked with it);
    another process, which cannot know, parks it saying that the last attempt's
    outcome is unknown, never that the consumer died in the handler."""
    settings = ConsumerSettings(
        queue=topology.queue, dsn=consumer_dsn, inbox_table=INBOX, max_attempts=2
    )
    info = psycopg.conninfo.conninfo_to_dict(consumer_dsn)
    proxy = TcpProxy(str(info.get("host", "127.0.0.1")), int(info.get("port", 5432)))
    store = InboxStore(proxied_dsn(consumer_dsn, proxy), INBOX, settings.consumer)
    other: InboxStore | None = None
    try:
        store.ensure_schema()
        processor = Processor(store, refuse, settings, ConsumerStats())
        copy = InboxMessage("k", b"x", {}, "ex", "k", None, True, topology.queue)
        assert processor.process(copy)[0] is Disposition.RETRY  # attempt 1, its error recorded
        proxy.arm(b"last_error = EXCLUDED.last_error")  # recording attempt 2's error
        with pytest.raises(DatabaseUnavailable):
            processor.process(copy)
        assert proxy.triggered.wait(5)  # set by the proxy's thread, just after the cut
        if next_copy == "same process":
            store.reconnect()  # what the consumer does after an outage
            outcome = processor.process(copy)[0]
            assert outcome is Disposition.DUPLICATE  # parked by the owed record, just before
        else:
            other = InboxStore(consumer_dsn, INBOX, settings.consumer)
            outcome = Processor(other, refuse, settings, ConsumerStats()).process(copy)[0]
            assert outcome is Disposition.PARKED
        [(error, attempts)] = rows(consumer_dsn, f"SELECT error, attempts FROM {INBOX}_parked")
        assert attempts == 2
        if next_copy == "same process":
            assert error.startswith("RuntimeError: the handler refuses"), error
            assert "then the database was unreachable" in error
        else:
            assert "the outcome of the last one unknown" in error, error
            assert "RuntimeError: the handler refuses" in error
            assert "while the handler ran" not in error, error
        assert scalar(consumer_dsn, f"SELECT count(*) FROM {INBOX}_attempts") == 0
    finally:
        store.close()
        if other is not None:
            other.close()
        proxy.close()


class SlowToRecord(InboxStore):
    """Records a failure only after ``delay`` seconds: the window between the
    replacement of a failed handler's session and the record of its error."""

    delay = 0.0

    def record_failure(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self.delay)
        return super().record_failure(*args, **kwargs)


def test_killer__a_copy_waits_for_the_error_of_a_failed_attempt_not_only_for_the_call(
    topology: Topology, consumer_dsn: str
) -> None:
    """A redelivered message's handler raises at its last attempt: its session is
    replaced (a failed handler's session is never reused), then its error is
    recorded and it is parked.  A consumer holding a copy waits on the attempt lock
    until that record is committed, so it finds the id (a duplicate) instead of a
    count without an error, which would park the message a second time with a
    wrong reason ("without a recorded outcome") and leave a count behind."""
    settings = ConsumerSettings(
        queue=topology.queue, dsn=consumer_dsn, inbox_table=INBOX, max_attempts=1
    )
    in_handler, release = threading.Event(), threading.Event()

    def held(conn: psycopg.Connection[object], message: InboxMessage) -> None:
        in_handler.set()
        assert release.wait(10)
        raise RuntimeError("the handler refuses")

    slow = SlowToRecord(consumer_dsn, INBOX, settings.consumer)
    slow.delay = 1.0
    stores = [slow, InboxStore(consumer_dsn, INBOX, settings.consumer, record_lock_timeout=WAIT)]
    stores[0].ensure_schema()
    try:
        a = Processor(stores[0], held, settings, ConsumerStats())
        b = Processor(stores[1], refuse, settings, ConsumerStats())
        copy = InboxMessage("c", b"x", {}, "ex", "k", None, True, topology.queue)
        results = b_waits_for_a(a, copy, b, copy, in_handler, release)
        assert results == {"a": Disposition.PARKED, "b": Disposition.DUPLICATE}
        [(error, attempts)] = rows(consumer_dsn, f"SELECT error, attempts FROM {INBOX}_parked")
        assert error.startswith("RuntimeError: the handler refuses") and attempts == 1, error
        assert scalar(consumer_dsn, f"SELECT count(*) FROM {INBOX}_attempts") == 0
    finally:
        for store in stores:
            store.close()
