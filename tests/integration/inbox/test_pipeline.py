"""Issue 21: a batch's handlers run in pipeline mode (their statements and the seal
resolved at one sync, then COMMIT), with what each handler sees unchanged: a result
it reads is waited for, a statement that fails breaks the batch, which is applied
again one by one without pipelining, and a handler that cannot run pipelined
switches it off."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
from psycopg.pq import PipelineStatus

from outbox.amqp.message import InboxMessage
from outbox.inbox.planning import Disposition
from tests.fixtures.servers import Topology
from tests.integration.inbox.test_inbox import (
    _message,
    _processor,
    effects,
    new_ids,
    record,
    scalar,
)


def _counters(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS counters (k text PRIMARY KEY, n int NOT NULL)")


def test_pipeline__a_batch_is_pipelined_and_a_handler_reading_rowcount_sees_it(
    topology: Topology, consumer_dsn: str
) -> None:
    """An upsert written with rowcount (UPDATE, and INSERT if no row changed): read
    before its result arrived, rowcount would be -1 and the INSERT skipped."""
    _counters(consumer_dsn)
    modes: list[PipelineStatus] = []

    def upsert(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        modes.append(conn.pgconn.pipeline_status)
        cur = conn.execute("UPDATE counters SET n = n + 1 WHERE k = %s", [message.body.decode()])
        if cur.rowcount == 0:
            conn.execute("INSERT INTO counters (k, n) VALUES (%s, 1)", [message.body.decode()])
        record(conn, message)

    processor = _processor(consumer_dsn, topology, upsert)
    try:
        batch = [
            InboxMessage(i, key.encode(), {}, "ex", "k", None, False, topology.queue)
            for i, key in zip(new_ids(4), ["a", "b", "a", "a"], strict=True)
        ]
        outcomes = [o for o, _ in processor.process_batch(batch)]
    finally:
        processor.store.close()
    assert outcomes == [Disposition.HANDLED] * 4
    assert modes == [PipelineStatus.ON] * 4
    assert scalar(consumer_dsn, "SELECT n FROM counters WHERE k = 'a'") == 3
    assert scalar(consumer_dsn, "SELECT n FROM counters WHERE k = 'b'") == 1
    assert len(effects(consumer_dsn)) == 4


def test_pipeline__a_failing_statement_fails_its_own_message_only(
    topology: Topology, consumer_dsn: str
) -> None:
    """The error of message 2's statement shows at the sync (or in a later handler);
    the batch is applied again one by one and only message 2 fails."""
    ids = new_ids(4)

    def handler(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        if message.message_id == ids[1]:
            conn.execute("SELECT 1 / 0")
        record(conn, message)

    processor = _processor(consumer_dsn, topology, handler)
    try:
        outcomes = [
            o for o, _ in processor.process_batch([_message(m, topology.queue) for m in ids])
        ]
    finally:
        processor.store.close()
    assert outcomes == [Disposition.HANDLED, Disposition.RETRY, *[Disposition.HANDLED] * 2]
    assert sorted(m for m, _ in effects(consumer_dsn)) == sorted([ids[0], *ids[2:]])
    assert processor.stats.handler_failures == 1
    assert processor.pipelining  # a real failure: pipelining stays on


@pytest.mark.parametrize("behaviour", ["copy", "catches_at_once"])
def test_pipeline__a_handler_that_cannot_run_pipelined_switches_it_off(
    topology: Topology, consumer_dsn: str, behaviour: str
) -> None:
    """COPY has no pipeline mode; a handler that catches a statement's error at once
    (with a savepoint) sees it later in pipeline mode.  Both apply every message,
    once, and later batches go without pipelining."""
    _counters(consumer_dsn)

    def handler(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        if behaviour == "copy":
            with conn.cursor().copy("COPY counters (k, n) FROM STDIN") as copy:
                copy.write_row([message.message_id, 1])
        else:
            try:
                with conn.transaction():
                    conn.execute("INSERT INTO counters (k, n) VALUES ('same', 1)")
            except psycopg.errors.UniqueViolation:
                conn.execute("UPDATE counters SET n = n + 1 WHERE k = 'same'")
        record(conn, message)

    processor = _processor(consumer_dsn, topology, handler)
    try:
        first = [
            o for o, _ in processor.process_batch([_message(m, topology.queue) for m in new_ids(3)])
        ]
        second = [
            o for o, _ in processor.process_batch([_message(m, topology.queue) for m in new_ids(3)])
        ]
    finally:
        processor.store.close()
    assert first == second == [Disposition.HANDLED] * 3
    assert processor.stats.handler_failures == 0
    assert len(effects(consumer_dsn)) == 6
    if behaviour == "catches_at_once":
        assert scalar(consumer_dsn, "SELECT n FROM counters WHERE k = 'same'") == 6
    else:
        assert scalar(consumer_dsn, "SELECT count(*) FROM counters") == 6


def test_pipeline__a_handler_outliving_the_idle_timeout_fails_only_its_message(
    topology: Topology, consumer_dsn: str
) -> None:
    """PostgreSQL applies idle_in_transaction_session_timeout only between synced
    statements, so in pipeline mode it would not end the session of a handler that
    sleeps past it: the loop fails that message itself, as the server would."""
    ids = new_ids(3)

    def handler(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        record(conn, message)
        if message.message_id == ids[1]:
            time.sleep(0.6)

    dsn = consumer_dsn + " options='-c idle_in_transaction_session_timeout=300'"
    processor = _processor(dsn, topology, handler)
    try:
        outcomes = [
            o for o, _ in processor.process_batch([_message(m, topology.queue) for m in ids])
        ]
    finally:
        processor.store.close()
    assert outcomes == [Disposition.HANDLED, Disposition.RETRY, Disposition.HANDLED]
    assert sorted(m for m, _ in effects(consumer_dsn)) == sorted([ids[0], ids[2]])


def test_pipeline__a_session_lost_in_a_batch_leaves_pipelining_on(
    topology: Topology, consumer_dsn: str
) -> None:
    """Issue 31, item 8: the server ends the consumer's session in the middle of a
    pipelined batch (``pg_terminate_backend`` from another session, as a restart or
    an operator would).  The batch is applied again one by one and every message
    succeeds; that is no sign of a handler that cannot run pipelined, so the next
    batch is pipelined again (before: pipelining stayed off for the process)."""
    modes: list[PipelineStatus] = []
    terminated: list[int] = []

    def handler(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        modes.append(conn.pgconn.pipeline_status)
        record(conn, message)
        if not terminated:
            terminated.append(conn.info.backend_pid)
            with psycopg.connect(consumer_dsn, autocommit=True) as other:
                other.execute("SELECT pg_terminate_backend(%s)", [conn.info.backend_pid])

    processor = _processor(consumer_dsn, topology, handler)
    try:
        first = [
            o for o, _ in processor.process_batch([_message(m, topology.queue) for m in new_ids(3)])
        ]
        modes.clear()
        second = [
            o for o, _ in processor.process_batch([_message(m, topology.queue) for m in new_ids(3)])
        ]
    finally:
        processor.store.close()
    assert first == second == [Disposition.HANDLED] * 3
    assert processor.pipelining
    assert modes == [PipelineStatus.ON] * 3
    assert len(effects(consumer_dsn)) == 6
