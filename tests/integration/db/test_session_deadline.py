"""The client deadline of operator sessions (``outbox.db.session.DeadlineConnection``):
a statement PostgreSQL stops answering ends within ``statement_timeout`` + margin with
``DatabaseUnavailable``, one whose answer trickles in within twice that; what
legitimately waits longer (a pipeline of statements, a long result that keeps coming
within that bound, a LISTEN wait, a migration without statement_timeout) is not cut.
A commit waiting for a synchronous standby is named as such, and Ctrl-C during a
silence ends the statement quietly.

Each test opens its session with ``client_deadline=True`` and reads its limit
(``silence``): both new, so each fails on code without the deadline.
"""

from __future__ import annotations

import _thread
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from outbox.db import session
from outbox.db.devcluster import PostgresCluster
from outbox.errors import CommitAwaitsStandby, DatabaseUnavailable, ExitCode
from tests.fixtures.faults import wait_for

STATEMENT_TIMEOUT = 1.0
# The deadline with STATEMENT_TIMEOUT: 1 s + the 2 s margin.
SILENCE = 3.0
# The bound on a whole statement's wait, its answer included: twice the deadline.
ANSWER_LIMIT = 6.0


@pytest.fixture
def bounded(dsn: str) -> Iterator[session.Conn]:
    conn = session.connect(
        dsn,
        application_name="outbox-test-deadline",
        connect_timeout=5,
        statement_timeout=STATEMENT_TIMEOUT,
        lock_timeout=STATEMENT_TIMEOUT,
        client_deadline=True,
    )
    assert getattr(conn, "silence", None) == SILENCE == session.silence_limit(STATEMENT_TIMEOUT)
    try:
        yield conn
    finally:
        conn.close()


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The backend ``pid`` stopped (SIGSTOP: its timers cannot fire, the kernel still
    acknowledges), continued afterwards."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_stopped_backend__the_statement_ends_after_timeout_and_margin_as_a_lost_session(
    bounded: session.Conn,
) -> None:
    pid = bounded.info.backend_pid
    with stopped(pid):
        started = time.monotonic()
        with (
            pytest.raises(DatabaseUnavailable) as raised,
            session.translated(bounded, "listing things"),
        ):
            bounded.execute("SELECT 1")
        took = time.monotonic() - started
    assert SILENCE <= took < SILENCE + 1.5, took
    assert raised.value.exit_code == ExitCode.UNREACHABLE
    assert raised.value.message.startswith(
        f"PostgreSQL did not answer while listing things: nothing came from PostgreSQL for "
        f"{SILENCE:g} s"
    ), raised.value.message
    assert "\n" not in raised.value.message
    assert "network" in raised.value.hint
    assert bounded.closed  # given up: never used again


def test_a_server_that_answers_with_its_own_timeout_keeps_the_session(
    bounded: session.Conn,
) -> None:
    """A server that answers (its statement_timeout fires at 1 s) is heard: the error is
    its own (57014), the session lives on."""
    with pytest.raises(psycopg.errors.QueryCanceled):
        bounded.execute("SELECT pg_sleep(2)")
    assert not bounded.closed
    assert bounded.execute("SELECT 1 AS one").fetchone() == {"one": 1}


def test_a_pipeline_silent_for_longer_than_the_deadline_is_not_cut(
    bounded: session.Conn,
) -> None:
    """Four statements of 0.9 s each (each within statement_timeout) in one pipeline:
    3.6 s in one wait, with nothing to read until the sync, longer than the deadline."""
    started = time.monotonic()
    with bounded.pipeline():
        cursors = [bounded.execute("SELECT pg_sleep(0.9), %s AS n", [n]) for n in range(4)]
    assert [c.fetchone()["n"] for c in cursors] == [0, 1, 2, 3]  # type: ignore[index]
    assert time.monotonic() - started > SILENCE
    assert not bounded.closed


def test_a_long_statement_that_keeps_sending_is_not_cut_a_silent_one_is(
    bounded: session.Conn,
) -> None:
    """The deadline counts silence (within the bound on the whole answer, twice the
    deadline: 6 s): without statement_timeout (as an online migration runs, though it
    lifts the deadline too), rows of 64 kB every 0.5 s for 4.5 s come through; 4.5 s of
    pg_sleep, silent, are cut at the deadline."""
    bounded.execute("SET statement_timeout = 0")
    rows = bounded.execute(
        "SELECT repeat('x', 65536) AS filler, pg_sleep(0.5) FROM generate_series(1, 9)"
    ).fetchall()
    assert len(rows) == 9
    started = time.monotonic()
    with pytest.raises(session.ServerSilent):
        bounded.execute("SELECT pg_sleep(4.5)")
    assert SILENCE <= time.monotonic() - started < SILENCE + 1.0
    assert bounded.closed


def test_without_deadline__a_silent_statement_may_take_its_time(bounded: session.Conn) -> None:
    """``without_deadline`` (an online migration's steps, statement_timeout 0)."""
    bounded.execute("SET statement_timeout = 0")
    with session.without_deadline(bounded):
        bounded.execute("SELECT pg_sleep(3.5)")
    assert getattr(bounded, "silence", None) == SILENCE  # back afterwards


def test_a_listen_wait_longer_than_the_deadline_is_not_cut(bounded: session.Conn, dsn: str) -> None:
    """``notifies()`` without a timeout waits on an idle session: no statement in flight."""
    bounded.execute("LISTEN outbox_test_deadline")

    def notify() -> None:
        time.sleep(SILENCE + 1)
        with psycopg.connect(dsn, autocommit=True) as other:
            other.execute("NOTIFY outbox_test_deadline, 'late'")

    sender = threading.Thread(target=notify, daemon=True)
    sender.start()
    started = time.monotonic()
    received = next(iter(bounded.notifies()))
    sender.join()
    assert received.payload == "late"
    assert time.monotonic() - started > SILENCE
    assert not bounded.closed


def test_an_answer_that_keeps_coming_past_twice_the_deadline_is_cut(
    bounded: session.Conn,
) -> None:
    """A statement's whole wait is bounded too (``ANSWER_FACTOR``): rows of 64 kB every
    0.5 s for 10 s (without statement_timeout, which would have ended it at 1 s) are
    cut at twice the deadline, never silent for long: an answer that trickles in."""
    assert session.ANSWER_FACTOR * SILENCE == ANSWER_LIMIT
    bounded.execute("SET statement_timeout = 0")
    started = time.monotonic()
    with (
        pytest.raises(DatabaseUnavailable) as raised,
        session.translated(bounded, "listing things"),
    ):
        bounded.execute(
            "SELECT repeat('x', 65536) AS filler, pg_sleep(0.5) FROM generate_series(1, 20)"
        ).fetchall()
    assert ANSWER_LIMIT <= time.monotonic() - started < ANSWER_LIMIT + 1.0
    assert isinstance(raised.value.__cause__, session.ServerTooSlow)
    assert raised.value.exit_code == ExitCode.UNREACHABLE
    assert f"still incomplete after {ANSWER_LIMIT:g} s" in raised.value.message
    assert bounded.closed


def test_ctrl_c_during_a_silence_cancels_quietly_and_closes(
    bounded: session.Conn, caplog: pytest.LogCaptureFixture
) -> None:
    """Ctrl-C 1 s into a stopped backend's silence: KeyboardInterrupt within the grace
    given to the cancel (the server cannot answer it), nothing logged (psycopg's own
    handling logs through the ``psycopg`` logger, here its cancellation interrupted by
    the deadline), the connection closed."""
    pid = bounded.info.backend_pid
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.0, _thread.interrupt_main)
    try:
        with caplog.at_level(logging.WARNING, logger="psycopg"), stopped(pid):
            timer.start()
            started = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                bounded.execute("SELECT 1")
            took = time.monotonic() - started
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert took < 1.0 + session.INTERRUPT_GRACE + 0.5, took
    logged = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("psycopg") and r.thread == threading.get_ident()
    ]
    assert logged == []
    assert bounded.closed


def test_a_commit_waiting_for_a_synchronous_standby_is_named() -> None:
    """A commit waiting for a synchronous standby that is down (``statement_timeout``
    does not bound that wait) is told from a silent server by a second session
    (``wait_event`` ``SyncRep``): ``CommitAwaitsStandby``, exit 6, naming
    synchronous_standby_names; the change is committed on the primary (seen by others
    once a standby confirms it or none is named)."""
    cluster = PostgresCluster(durable=False, max_prepared_transactions=0)
    cluster.start()
    try:
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (n int)")
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = 'absent_standby'")
            conn.execute("SELECT pg_reload_conf()")
        time.sleep(0.5)
        conn = session.connect(
            cluster.dsn,
            application_name="outbox-test-deadline",
            connect_timeout=5,
            statement_timeout=STATEMENT_TIMEOUT,
            client_deadline=True,
        )
        started = time.monotonic()
        with (
            pytest.raises(CommitAwaitsStandby) as raised,
            session.translated(conn, "inserting things"),
        ):
            conn.execute("INSERT INTO t VALUES (1)")
        took = time.monotonic() - started
        # Committed, visible to others once the backend stops waiting (it does not
        # notice its client left): here, when no standby is named any more.
        with psycopg.connect(cluster.dsn, autocommit=True) as other:
            assert other.execute("SELECT count(*) FROM t").fetchone() == (0,)
            other.execute("ALTER SYSTEM RESET synchronous_standby_names")
            other.execute("SELECT pg_reload_conf()")
            wait_for(
                lambda: other.execute("SELECT count(*) FROM t").fetchone() == (1,),
                10,
                "the insert to be visible",
            )
    finally:
        cluster.destroy()
    assert SILENCE <= took < SILENCE + 2.0, took
    assert raised.value.exit_code == ExitCode.TIMED_OUT
    message = raised.value.message
    assert message.startswith("gave up waiting while inserting things: "), message
    assert "committed on the primary" in message and "'absent_standby'" in message, message
    assert "synchronous_standby_names" in raised.value.hint
    assert "safe" in raised.value.hint
    assert conn.closed
