"""The consumer's inbox (``outbox consume`` / ``outbox.inbox.process``) against real servers.

The consumer's database is a separate, empty database (``empty_dsn``), as it is in
production; the handler writes one row per message into ``effects``, a table
WITHOUT a unique constraint, so a doubled effect would show as two rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pika
import psycopg
import pytest

from outbox.amqp.message import InboxMessage
from outbox.config import Settings
from outbox.db.inbox import InboxStore, ParkedStore
from outbox.inbox import parked
from outbox.inbox.planning import Disposition
from outbox.inbox.process import Inbox
from outbox.inbox.settings import ConsumerSettings
from outbox.inbox.steps import Processor, parking_for
from tests.fixtures.faults import (
    RelayProcess,
    TcpProxy,
    drain,
    insert_rows,
    proxied_amqp_url,
    proxied_dsn,
    wait_for,
)
from tests.fixtures.servers import Topology

INBOX = "inbox"

# The handler module the subprocess tests load with `outbox consume handlers:<fn>`.
HANDLERS = '''
import os, signal, time

def record(conn, message):
    conn.execute(
        "INSERT INTO effects (message_id, body) VALUES (%s, %s)",
        [message.message_id, message.body],
    )

def crash_once(conn, message):
    """Writes the effect, then dies with kill -9 before the commit (first call only)."""
    record(conn, message)
    marker = os.environ["CRASH_MARKER"]
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)

def slow(conn, message):
    with open(os.environ["STARTED_MARKER"], "a") as started:
        started.write(message.message_id + "\\n")
    time.sleep(1.5)
    record(conn, message)
'''


# -- helpers -----------------------------------------------------------------------
def create_effects_table(dsn: str) -> str:
    """The application's effect table: deliberately no unique constraint."""
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "CREATE TABLE effects (n bigserial, message_id text, body bytea, "
            "at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
    return dsn


def record(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
    conn.execute(
        "INSERT INTO effects (message_id, body) VALUES (%s, %s)",
        [message.message_id, message.body],
    )


def effects(dsn: str) -> list[tuple[str, bytes]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT message_id, body FROM effects ORDER BY n").fetchall()
    return [(r[0], bytes(r[1])) for r in rows]


def scalar(dsn: str, query: str, params: Any = None) -> Any:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def publish(
    topology: Topology,
    bodies: list[tuple[str | None, bytes]],
    *,
    headers: dict[str, Any] | None = None,
) -> None:
    """Publish (message_id, body) pairs, persistent, to the test's exchange."""
    ch = topology.channel()
    ch.confirm_delivery()
    for message_id, body in bodies:
        props = pika.BasicProperties(delivery_mode=2, message_id=message_id, headers=headers)
        ch.basic_publish(topology.exchange, "k", body, props)
    ch.connection.close()


def ready_messages(topology: Topology) -> int:
    ch = topology.channel()
    count = int(ch.queue_declare(topology.queue, passive=True).method.message_count)
    ch.connection.close()
    return count


def new_ids(count: int) -> list[str]:
    return [str(uuid.uuid4()) for _ in range(count)]


def consumer_settings(topology: Topology, dsn: str, **overrides: Any) -> ConsumerSettings:
    base = ConsumerSettings(
        queue=topology.queue,
        dsn=dsn,
        amqp_url=topology.amqp_url,
        inbox_table=INBOX,
        retry_delay=0.01,
        retry_delay_max=0.05,
        backoff_initial=0.05,
        backoff_max=0.5,
        connect_timeout=3.0,
    )
    return dataclasses.replace(base, **overrides)


@contextlib.contextmanager
def running(inbox: Inbox) -> Iterator[Inbox]:
    """``inbox.run()`` in a thread; stopped (and joined) when the block ends."""
    inbox.start()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            inbox.run()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield inbox
    finally:
        inbox.stop()
        thread.join(timeout=30)
    assert not thread.is_alive(), "the consumer did not stop"
    assert not errors, errors


class ConsumeProcess:
    """``outbox consume handlers:<function>`` in a subprocess, from a folder holding
    the handler module (the way a user runs it)."""

    def __init__(
        self,
        folder: Path,
        function: str,
        dsn: str,
        topology: Topology,
        *,
        extra_env: dict[str, str] | None = None,
        amqp_url: str | None = None,
    ) -> None:
        (folder / "handlers.py").write_text(HANDLERS)
        env = dict(os.environ)
        env.pop("OUTBOX_CRASH_AT", None)
        env.update(
            OUTBOX_DSN=dsn,
            OUTBOX_AMQP_URL=amqp_url or topology.amqp_url,
            OUTBOX_QUEUE=topology.queue,
            OUTBOX_INBOX_TABLE=INBOX,
            OUTBOX_RETRY_DELAY="0.01",
            OUTBOX_BACKOFF_INITIAL="0.05",
            OUTBOX_BACKOFF_MAX="0.5",
            OUTBOX_CONNECT_TIMEOUT="3",
            OUTBOX_LOG_LEVEL="debug",
        )
        env.update(extra_env or {})
        self._log = tempfile.TemporaryFile()  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-m", "outbox", "consume", f"handlers:{function}"],
            cwd=folder,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        if self._log.closed:
            return self._final
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def wait(self, timeout: float = 30.0) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"consumer did not exit within {timeout}s:\n{self.output()[-3000:]}")

    def terminate(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.wait()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self.process.wait(timeout=30)

    def close(self) -> None:
        if self.process.poll() is None:
            self.kill()
        self._final = self.output()
        self._log.close()


# -- exactly once -------------------------------------------------------------------
def test_inbox__applies_each_message_once_and_acks_it(
    topology: Topology, consumer_dsn: str
) -> None:
    ids = new_ids(20)
    publish(topology, [(i, f"body {i}".encode()) for i in ids])
    inbox = Inbox(record, consumer_settings(topology, consumer_dsn))
    with running(inbox):
        wait_for(lambda: len(effects(consumer_dsn)) == 20, 20, "20 effects")
    assert effects(consumer_dsn) == [(i, f"body {i}".encode()) for i in ids]
    assert scalar(consumer_dsn, "SELECT count(*) FROM inbox") == 20
    assert inbox.stats.handled == 20 and inbox.stats.duplicates_skipped == 0
    assert ready_messages(topology) == 0
    assert topology.messages() == []  # acked, not merely in flight


def test_inbox__copies_of_a_message_id_are_skipped_and_acked(
    topology: Topology, consumer_dsn: str
) -> None:
    ids = new_ids(5)
    publish(topology, [(i, b"first") for i in ids] + [(i, b"copy") for i in ids[:3]])
    inbox = Inbox(record, consumer_settings(topology, consumer_dsn))
    with running(inbox):
        wait_for(lambda: inbox.stats.duplicates_skipped == 3, 20, "3 duplicates skipped")
    assert effects(consumer_dsn) == [(i, b"first") for i in ids]
    assert inbox.stats.handled == 5
    assert topology.messages() == []


def test_inbox__duplicates_from_a_relay_crash_have_one_effect_each(
    settings: Settings, topology: Topology, consumer_dsn: str
) -> None:
    committed = insert_rows(settings.dsn, topology.exchange, 10)
    # kill -9 after every confirm, before the ledger record: the batch is rolled back
    # and published again by the next relay, so every message arrives twice.
    crashing = RelayProcess(settings, crash_at="after_publish")
    try:
        assert crashing.wait() == -signal.SIGKILL, crashing.output()
    finally:
        crashing.close()
    drain(settings)
    assert ready_messages(topology) == 20

    inbox = Inbox(record, consumer_settings(topology, consumer_dsn))
    with running(inbox):
        wait_for(lambda: inbox.stats.duplicates_skipped == 10, 20, "10 duplicates skipped")
    assert sorted(m for m, _ in effects(consumer_dsn)) == sorted(committed)
    assert inbox.stats.handled == 10
    assert ready_messages(topology) == 0


def _processor(dsn: str, topology: Topology, handler: Callable[..., object]) -> Processor:
    settings = consumer_settings(topology, dsn)
    store = InboxStore(dsn, INBOX, settings.consumer)
    store.ensure_schema()
    return Processor(store, handler, settings, Inbox(handler, settings).stats)


def _message(message_id: str, queue: str, *, redelivered: bool = False) -> InboxMessage:
    return InboxMessage(message_id, b"x", {}, "ex", "k", None, redelivered, queue)


@pytest.mark.parametrize("first_outcome", ["commits", "fails"])
def test_inbox__two_consumers_racing_on_one_id_apply_it_once(
    topology: Topology, consumer_dsn: str, first_outcome: str
) -> None:
    """Consumer B gets a copy while consumer A is inside its handler: B finds the
    inbox id held (a short wait, no attempt counted, no handler call), keeps the copy
    in hand and tries it again, and then learns A's outcome (committed: duplicate;
    rolled back: B applies it)."""
    in_handler, release = threading.Event(), threading.Event()

    def held(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        record(conn, message)
        in_handler.set()
        assert release.wait(10)
        if first_outcome == "fails":
            raise RuntimeError("A fails")

    a = _processor(consumer_dsn, topology, held)
    b = _processor(consumer_dsn, topology, record)
    message_id = new_ids(1)[0]
    results: dict[str, Disposition] = {}
    thread_a = threading.Thread(
        target=lambda: results.__setitem__("a", a.process(_message(message_id, topology.queue))[0])
    )
    thread_a.start()
    assert in_handler.wait(10)
    started = time.monotonic()
    assert b.process(_message(message_id, topology.queue))[0] is Disposition.HELD
    assert time.monotonic() - started < 2.0  # one short wait, not the handler's length
    release.set()
    thread_a.join(10)
    again = b.process(_message(message_id, topology.queue))[0]
    if first_outcome == "commits":
        assert (results["a"], again) == (Disposition.HANDLED, Disposition.DUPLICATE)
    else:
        assert (results["a"], again) == (Disposition.RETRY, Disposition.HANDLED)
    assert [m for m, _ in effects(consumer_dsn)] == [message_id]
    a.store.close()
    b.store.close()


def test_inbox__messages_already_here_commit_as_one_transaction(
    topology: Topology, consumer_dsn: str
) -> None:
    transactions: list[int] = []
    calls: list[str] = []

    def handler(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        calls.append(str(message.message_id))
        row = conn.execute("SELECT txid_current()").fetchone()
        assert row is not None
        transactions.append(row[0])
        record(conn, message)

    processor = _processor(consumer_dsn, topology, handler)
    try:
        earlier, *fresh = new_ids(4)
        assert processor.process(_message(earlier, topology.queue))[0] is Disposition.HANDLED
        batch = [_message(m, topology.queue) for m in [*fresh, earlier, fresh[0]]]
        outcomes = [outcome for outcome, _ in processor.process_batch(batch)]
    finally:
        processor.store.close()
    assert outcomes == [Disposition.HANDLED] * 3 + [Disposition.DUPLICATE] * 2
    # Recorded ahead, the batch met ``earlier``: its INSERT failed, so the first
    # handler's result was an error (or, psycopg having read that error while the
    # block's first statements went out, no handler ran ahead); rolled back and run
    # again ids first: the three fresh ones, one commit.
    assert calls in ([earlier, fresh[0], *fresh], [earlier, *fresh])
    assert len(transactions) == 1 + 3 and len(set(transactions[1:])) == 1
    assert sorted(m for m, _ in effects(consumer_dsn)) == sorted([earlier, *fresh])


def test_inbox__a_batch_with_a_failing_message_is_applied_one_by_one(
    topology: Topology, consumer_dsn: str
) -> None:
    ids = new_ids(4)

    def handler(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        record(conn, message)
        if message.message_id == ids[2]:
            raise ValueError("bad")

    processor = _processor(consumer_dsn, topology, handler)
    try:
        outcomes = processor.process_batch([_message(m, topology.queue) for m in ids])
    finally:
        processor.store.close()
    assert [o for o, _ in outcomes] == [Disposition.HANDLED] * 2 + [
        Disposition.RETRY,
        Disposition.HANDLED,
    ]
    assert outcomes[2][1] > 0  # a retry delay
    assert [m for m, _ in effects(consumer_dsn)] == [ids[0], ids[1], ids[3]]
    assert processor.stats.handler_failures == 1


# -- crashes --------------------------------------------------------------------------
def test_inbox__crash_after_commit_before_ack_skips_the_redelivery(
    topology: Topology, consumer_dsn: str, tmp_path: Path
) -> None:
    [message_id] = new_ids(1)
    publish(topology, [(message_id, b"once")])
    crashing = ConsumeProcess(
        tmp_path,
        "record",
        consumer_dsn,
        topology,
        extra_env={"OUTBOX_CRASH_AT": "consume_after_commit"},
    )
    try:
        assert crashing.wait() == -signal.SIGKILL, crashing.output()
    finally:
        crashing.close()
    assert effects(consumer_dsn) == [(message_id, b"once")]  # committed
    wait_for(lambda: ready_messages(topology) == 1, 10, "the unacked message to return")

    again = ConsumeProcess(tmp_path, "record", consumer_dsn, topology)
    try:
        wait_for(lambda: "consumer.duplicate_skipped" in again.output(), 20, "the skip")
        assert again.terminate() == 0, again.output()
    finally:
        again.close()
    assert "1 handled" not in again.output() and "1 duplicates skipped" in again.output()
    assert effects(consumer_dsn) == [(message_id, b"once")]
    assert ready_messages(topology) == 0


def test_inbox__crash_inside_the_handler_applies_the_message_once_after_restart(
    topology: Topology, consumer_dsn: str, tmp_path: Path
) -> None:
    ids = new_ids(3)
    publish(topology, [(i, i.encode()) for i in ids])
    marker = tmp_path / "crashed"
    env = {"CRASH_MARKER": str(marker)}
    first = ConsumeProcess(tmp_path, "crash_once", consumer_dsn, topology, extra_env=env)
    try:
        assert first.wait() == -signal.SIGKILL, first.output()
    finally:
        first.close()
    assert marker.exists()
    assert effects(consumer_dsn) == []  # the effect written before the kill rolled back

    second = ConsumeProcess(tmp_path, "crash_once", consumer_dsn, topology, extra_env=env)
    try:
        wait_for(lambda: len(effects(consumer_dsn)) == 3, 20, "3 effects")
        assert second.terminate() == 0, second.output()
    finally:
        second.close()
    assert sorted(effects(consumer_dsn)) == sorted((i, i.encode()) for i in ids)
    assert ready_messages(topology) == 0


def test_inbox__sigterm_finishes_the_message_in_hand_and_exits_0(
    topology: Topology, consumer_dsn: str, tmp_path: Path
) -> None:
    ids = new_ids(3)
    publish(topology, [(i, b"slow") for i in ids])
    started = tmp_path / "started"
    consumer = ConsumeProcess(  # prefetch 1: one message in hand (else: the batch in hand)
        tmp_path,
        "slow",
        consumer_dsn,
        topology,
        extra_env={"STARTED_MARKER": str(started), "OUTBOX_PREFETCH": "1"},
    )
    try:
        wait_for(started.exists, 20, "the handler to start")
        assert consumer.terminate() == 0, consumer.output()
    finally:
        consumer.close()
    [in_hand] = started.read_text().split()
    assert effects(consumer_dsn) == [(in_hand, b"slow")]  # committed, not cut short
    assert ready_messages(topology) == 2  # acked; the other two went back unacked
    assert "1 handled" in consumer.output()


def test_inbox__database_lost_during_commit_is_decided_by_the_inbox(
    topology: Topology, consumer_dsn: str
) -> None:
    """The server runs the COMMIT, the consumer never hears back: outcome unknown.
    The message is not acked; it comes back, and the inbox knows it was applied."""
    info = psycopg.conninfo.conninfo_to_dict(consumer_dsn)
    proxy = TcpProxy(str(info.get("host", "127.0.0.1")), int(info.get("port", 5432)))
    try:
        ids = new_ids(3)
        inbox = Inbox(record, consumer_settings(topology, proxied_dsn(consumer_dsn, proxy)))
        inbox.start()  # creates the tables before the cut is armed
        proxy.arm(b"COMMIT", after_server=True)
        publish(topology, [(i, b"x") for i in ids])
        with running(inbox):
            wait_for(lambda: inbox.stats.handled + inbox.stats.duplicates_skipped == 3, 30)
        assert proxy.triggered.is_set()
        assert inbox.stats.reconnects >= 1
        # What was committed in the dark (one message, or a batch) came back and was
        # skipped; the rest was applied after the reconnect.
        assert inbox.stats.duplicates_skipped >= 1
    finally:
        proxy.close()
    assert sorted(m for m, _ in effects(consumer_dsn)) == sorted(ids)
    assert ready_messages(topology) == 0


def test_inbox__broker_connection_cut_reconnects_and_applies_everything_once(
    topology: Topology, consumer_dsn: str
) -> None:
    params = pika.URLParameters(topology.amqp_url)
    proxy = TcpProxy(params.host, params.port)
    try:
        settings = consumer_settings(
            topology, consumer_dsn, amqp_url=proxied_amqp_url(topology.amqp_url, proxy)
        )
        inbox = Inbox(record, settings)
        first, second = new_ids(5), new_ids(5)
        publish(topology, [(i, b"x") for i in first])
        with running(inbox):
            wait_for(lambda: inbox.stats.handled == 5, 20, "the first 5")
            proxy.cut_all()
            publish(topology, [(i, b"x") for i in second])
            wait_for(lambda: inbox.stats.handled == 10, 30, "the next 5 after the cut")
        assert inbox.stats.reconnects >= 1
    finally:
        proxy.close()
    assert sorted(m for m, _ in effects(consumer_dsn)) == sorted(first + second)


# -- failures and parking ------------------------------------------------------------------
def test_inbox__a_handler_that_always_fails_is_parked_and_does_not_block_the_queue(
    topology: Topology, consumer_dsn: str
) -> None:
    bad, *good = new_ids(3)
    fixed = threading.Event()

    def handler(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        if message.message_id == bad and not fixed.is_set():
            raise ValueError(f"cannot handle {message.message_id}")
        record(conn, message)

    publish(topology, [(bad, b"bad")], headers={"tenant": "acme"})
    publish(topology, [(g, b"good") for g in good])
    inbox = Inbox(handler, consumer_settings(topology, consumer_dsn, max_attempts=3))
    with running(inbox):
        wait_for(lambda: inbox.stats.parked == 1 and inbox.stats.handled == 2, 20)
    assert sorted(m for m, _ in effects(consumer_dsn)) == sorted(good)
    assert (inbox.stats.handler_failures, inbox.stats.retried) == (3, 2)
    assert ready_messages(topology) == 0

    store = ParkedStore(consumer_dsn, INBOX)
    try:
        [entry] = store.entries(10)
        assert entry["message_id"] == bad and entry["attempts"] == 3
        assert entry["error"].startswith(f"ValueError: cannot handle {bad}")
        assert entry["queue"] == topology.queue
        assert (entry["exchange"], entry["routing_key"]) == (topology.exchange, "k")
        assert entry["headers"] == {"tenant": "acme"}
        assert scalar(consumer_dsn, "SELECT count(*) FROM inbox_attempts") == 0
        # Its id is in the inbox: a late copy is skipped, not applied.
        assert scalar(consumer_dsn, "SELECT count(*) FROM inbox WHERE message_id = %s", [bad])

        fixed.set()  # the fix; then retry: back on the queue, applied once
        assert parked.retry(store, topology.amqp_url, None) == [bad]
        assert store.entries(10) == []
    finally:
        store.close()
    seen: list[InboxMessage] = []

    def fixed_handler(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        seen.append(message)
        handler(conn, message)

    inbox = Inbox(fixed_handler, consumer_settings(topology, consumer_dsn))
    with running(inbox):
        wait_for(lambda: inbox.stats.handled == 1, 20, "the retried message")
    assert sorted(m for m, _ in effects(consumer_dsn)) == sorted([*good, bad])
    [message] = seen  # the handler sees where it first came from
    assert (message.exchange, message.routing_key, message.headers) == (
        topology.exchange,
        "k",
        {"tenant": "acme"},
    )


class Died(Exception):
    pass


def test_inbox__retry_that_dies_before_removing_the_parked_row_applies_the_message_once(
    topology: Topology, consumer_dsn: str
) -> None:
    """The retry's steps: release the inbox id (committed), publish, crash before the
    parked row goes.  The copy is applied (nothing of the retry holds its inbox row);
    the message is still listed, and a second retry's copy is skipped as a duplicate:
    nothing is applied twice or lost."""
    [bad] = new_ids(1)
    publish(topology, [(bad, b"bad")])

    def failing(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        raise ValueError("no")

    inbox = Inbox(failing, consumer_settings(topology, consumer_dsn, max_attempts=1))
    with running(inbox):
        wait_for(lambda: inbox.stats.parked == 1, 20)
    store = ParkedStore(consumer_dsn, INBOX)
    try:
        [(parked_id, _)] = store.retry_sizes(None, after=0, last=2**62, limit=10)
        [row] = store.release([parked_id])
        ch = topology.channel()
        ch.basic_publish(
            "", topology.queue, bytes(row["body"]), pika.BasicProperties(message_id=bad)
        )
        ch.connection.close()
        # ... and the retry dies here, before step 3.
        assert [e["message_id"] for e in store.entries(10)] == [bad]
        inbox = Inbox(record, consumer_settings(topology, consumer_dsn))
        with running(inbox):
            wait_for(lambda: inbox.stats.handled == 1, 20, "the copy to be applied")
            assert parked.retry(store, topology.amqp_url, None) == [bad]
            wait_for(lambda: inbox.stats.duplicates_skipped == 1, 20, "the 2nd copy skipped")
        assert store.entries(10) == []
    finally:
        store.close()
    assert effects(consumer_dsn) == [(bad, b"bad")]


def test_inbox__a_failure_of_a_copy_whose_original_was_applied_parks_nothing(
    topology: Topology, consumer_dsn: str
) -> None:
    """Copy B fails while copy A of the same message commits: B must not park (and so
    block) a message whose effect exists; it counts as a duplicate."""
    processor = _processor(consumer_dsn, topology, record)
    [message_id] = new_ids(1)
    message = _message(message_id, topology.queue)
    try:
        assert processor.process(message)[0] is Disposition.HANDLED
        failure = processor.store.record_failure(
            message_id, "B failed", max_attempts=1, parking=parking_for(message, "B failed")
        )
    finally:
        processor.store.close()
    assert (failure.parked, failure.duplicate) == (False, True)
    assert scalar(consumer_dsn, "SELECT count(*) FROM inbox_parked") == 0
    assert scalar(consumer_dsn, "SELECT count(*) FROM inbox_attempts") == 0


def test_inbox__a_message_without_message_id_is_parked_without_calling_the_handler(
    topology: Topology, consumer_dsn: str
) -> None:
    calls: list[InboxMessage] = []

    def handler(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        calls.append(message)
        record(conn, message)

    [good] = new_ids(1)
    publish(topology, [(None, b"anonymous"), (good, b"good")])
    inbox = Inbox(handler, consumer_settings(topology, consumer_dsn))
    with running(inbox):
        wait_for(lambda: inbox.stats.handled == 1 and inbox.stats.parked == 1, 20)
    assert [m.message_id for m in calls] == [good]
    store = ParkedStore(consumer_dsn, INBOX)
    try:
        [entry] = store.entries(10)
    finally:
        store.close()
    assert entry["message_id"] is None and "cannot be deduplicated" in entry["error"]
    assert ready_messages(topology) == 0


def test_inbox__a_handler_that_swallows_a_database_error_is_not_acked_as_applied(
    topology: Topology, consumer_dsn: str
) -> None:
    """psycopg 'commits' an aborted transaction without complaint; the inbox must not."""

    def swallowing(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        record(conn, message)
        with contextlib.suppress(psycopg.Error):
            conn.execute("SELECT 1/0")

    [message_id] = new_ids(1)
    publish(topology, [(message_id, b"x")])
    inbox = Inbox(swallowing, consumer_settings(topology, consumer_dsn, max_attempts=2))
    with running(inbox):
        wait_for(lambda: inbox.stats.parked == 1, 20)
    assert inbox.stats.handled == 0
    assert effects(consumer_dsn) == []
    store = ParkedStore(consumer_dsn, INBOX)
    try:
        [entry] = store.entries(10)
    finally:
        store.close()
    assert "caught a database error" in entry["error"]


def test_inbox__a_commit_refused_by_a_deferred_constraint_is_a_handler_failure(
    topology: Topology, consumer_dsn: str
) -> None:
    with psycopg.connect(consumer_dsn) as conn:
        conn.execute(
            "CREATE TABLE parents (id int PRIMARY KEY);"
            "CREATE TABLE children (parent int REFERENCES parents DEFERRABLE INITIALLY DEFERRED)"
        )

    def orphan(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        record(conn, message)
        conn.execute("INSERT INTO children VALUES (42)")  # fails only at COMMIT

    [message_id] = new_ids(1)
    publish(topology, [(message_id, b"x")])
    inbox = Inbox(orphan, consumer_settings(topology, consumer_dsn, max_attempts=2))
    with running(inbox):
        wait_for(lambda: inbox.stats.parked == 1, 20)
    assert inbox.stats.handler_failures == 2 and inbox.stats.reconnects == 0
    assert effects(consumer_dsn) == []


# -- order ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("prefetch", "order"), [(1, [0, 1, 2]), (10, [0, 1, 2])])
def test_inbox__a_retried_earlier_message_of_a_key_is_applied_before_later_ones(
    topology: Topology, consumer_dsn: str, prefetch: int, order: list[int]
) -> None:
    """Message 0 fails twice (a batch that fails is retried one message at a time, so
    twice is what holds it for a retry even in a batch).  With prefetch 1 the broker
    holds 1 and 2 until 0 is settled; with a larger prefetch 1 and 2 are already here
    and wait behind 0, their ordering key's failing message (issue 31; before, they
    overtook it)."""
    ids = new_ids(3)
    calls: list[str] = []

    def fails_twice(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        assert message.ordering_key == "order-7"
        calls.append(str(message.message_id))
        if message.message_id == ids[0] and calls.count(ids[0]) <= 2:
            raise RuntimeError("transient")
        record(conn, message)

    publish(
        topology,
        [(i, str(n).encode()) for n, i in enumerate(ids)],
        headers={"x-ordering-key": "order-7"},
    )
    inbox = Inbox(fails_twice, consumer_settings(topology, consumer_dsn, prefetch=prefetch))
    with running(inbox):
        wait_for(lambda: inbox.stats.handled == 3, 20)
    assert [m for m, _ in effects(consumer_dsn)] == [ids[n] for n in order]


# -- retention ------------------------------------------------------------------------------
def test_inbox__retention_deletes_old_ids_in_batches_but_keeps_parked_ones(
    topology: Topology, consumer_dsn: str
) -> None:
    settings = consumer_settings(topology, consumer_dsn)
    store = InboxStore(consumer_dsn, INBOX, settings.consumer)
    store.ensure_schema()
    with psycopg.connect(consumer_dsn) as conn:
        conn.execute(
            "INSERT INTO inbox (consumer, message_id, received_at) "
            "SELECT %s, 'old-' || i, now() - interval '8 days' FROM generate_series(1, 25) i",
            [settings.consumer],
        )
        conn.execute(
            "INSERT INTO inbox (consumer, message_id, received_at) "
            "SELECT %s, 'new-' || i, now() - interval '6 days' FROM generate_series(1, 5) i",
            [settings.consumer],
        )
        conn.execute(  # another consumer's old id is its own business
            "INSERT INTO inbox (consumer, message_id, received_at) "
            "VALUES ('someone-else', 'old-1', now() - interval '30 days')"
        )
        conn.execute(
            "INSERT INTO inbox_parked (consumer, message_id, queue, exchange, routing_key, "
            "body, headers, properties, error, attempts) "
            "VALUES (%s, 'old-1', 'q', 'e', 'k', '', '{}', '{}', 'test', 5)",
            [settings.consumer],
        )
    try:
        week = 7 * 86400.0
        assert store.prune(week, batch=10, max_batches=2) == 20  # two batches of 10
        assert store.prune(week, batch=10, max_batches=2) == 4  # the rest, old-1 kept
        assert store.prune(week, batch=10, max_batches=2) == 0
    finally:
        store.close()
    with psycopg.connect(consumer_dsn) as conn:
        left = conn.execute("SELECT consumer, message_id FROM inbox ORDER BY 1, 2").fetchall()
    kept = [(settings.consumer, "new-" + str(i)) for i in range(1, 6)]
    assert left == sorted([(settings.consumer, "old-1"), *kept, ("someone-else", "old-1")])


def test_inbox__the_consumer_prunes_at_start_and_a_pruned_id_is_applied_again(
    topology: Topology, consumer_dsn: str
) -> None:
    """What the retention window means: a redelivery older than it counts as new."""
    [message_id] = new_ids(1)
    settings = consumer_settings(topology, consumer_dsn, inbox_retention=3600.0)
    publish(topology, [(message_id, b"first")])
    inbox = Inbox(record, settings)
    with running(inbox):
        wait_for(lambda: inbox.stats.handled == 1, 20)
    with psycopg.connect(consumer_dsn) as conn:
        conn.execute("UPDATE inbox SET received_at = now() - interval '2 hours'")
    publish(topology, [(message_id, b"late copy")])
    inbox = Inbox(record, settings)
    with running(inbox):
        wait_for(lambda: inbox.stats.handled == 1, 20)
    assert inbox.stats.pruned == 1
    assert effects(consumer_dsn) == [(message_id, b"first"), (message_id, b"late copy")]


# -- metrics and health -----------------------------------------------------------------------
def test_endpoints__consumer_counters_histogram_parked_gauge_and_probes(
    topology: Topology, consumer_dsn: str
) -> None:
    from outbox.inbox.metrics import ConsumerEndpoints
    from outbox.probes import LIVENESS_PATH, READINESS_PATH
    from tests.integration.ops.test_observability import get, scrape

    ids = new_ids(4)

    def handler(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        if message.message_id == ids[0]:
            raise ValueError("never")
        record(conn, message)

    inbox = Inbox(handler, consumer_settings(topology, consumer_dsn, max_attempts=2))
    publish(topology, [(i, b"x") for i in ids] + [(ids[1], b"copy")])
    inbox.start()
    endpoints = ConsumerEndpoints(inbox, port=0, address="127.0.0.1", cache_seconds=0).start()
    try:
        with running(inbox):
            wait_for(lambda: inbox.stats.handled == 3 and inbox.stats.parked == 1, 20)
            wait_for(lambda: inbox.stats.duplicates_skipped == 1, 20)
            metrics = scrape(endpoints)
            assert get(endpoints, READINESS_PATH) == (200, "ok\n")
            assert get(endpoints, LIVENESS_PATH) == (200, "ok\n")
        status, body = get(endpoints, READINESS_PATH)
    finally:
        endpoints.close()
    assert metrics["outbox_consumer_handled_total"] == 3
    assert metrics["outbox_consumer_duplicates_skipped_total"] == 1
    assert metrics["outbox_consumer_handler_failures_total"] == 2
    assert metrics["outbox_consumer_parked_total{reason=failed}"] == 1
    assert metrics["outbox_consumer_parked_total{reason=unfinished}"] == 0
    assert metrics["outbox_consumer_parked_total{reason=unusable}"] == 0
    assert metrics["outbox_consumer_parked_messages"] == 1
    # Every call: 3 that committed, 2 that failed, and any batch attempt that was
    # split up because one of its messages failed.
    assert metrics["outbox_consumer_handler_duration_seconds_count"] >= 5
    assert metrics["outbox_consumer_broker_up"] == 1
    assert metrics["outbox_consumer_database_up"] == 1
    assert status == 503 and "stopping" in body


def test_inbox__outages_leave_no_thread_behind(topology: Topology, consumer_dsn: str) -> None:
    """Each broker connection the consumer replaces takes its heartbeat thread with
    it: after four database outages there is at most one, as after none, and none
    once it stops.  (A closed connection's heartbeat thread used to wait out half
    an interval, 30 s, before it ended: five were alive here.)"""

    def threads() -> int:
        return sum(1 for t in threading.enumerate() if t.name.startswith("outbox-heartbeats"))

    before = threads()
    inbox = Inbox(record, consumer_settings(topology, consumer_dsn))
    applied = 0
    with running(inbox):
        for _ in range(5):
            ids = new_ids(20)
            publish(topology, [(i, b"x") for i in ids])
            applied += len(ids)
            wait_for(lambda n=applied: inbox.stats.handled == n, 30, "the batch")
            scalar(
                consumer_dsn,
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = 'outbox-consume'",
            )
        # The next batch finds each of the first four sessions gone: an outage each.
        assert inbox.stats.reconnects >= 4
        assert threads() <= before + 1
    wait_for(lambda: threads() == before, 5, "the stopped consumer's threads to end")
