"""The client deadline of operator sessions (``outbox.db.session.DeadlineConnection``):
a statement PostgreSQL stops answering ends within ``statement_timeout`` + margin with
``DatabaseUnavailable``; what legitimately waits longer (a pipeline of statements, a
long result that keeps coming, a LISTEN wait, a migration without statement_timeout)
is not cut.

Each test opens its session with ``client_deadline=True`` and reads its limit
(``silence``): both new, so each fails on code without the deadline.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from outbox.db import session
from outbox.errors import DatabaseUnavailable, ExitCode

STATEMENT_TIMEOUT = 1.0
# The deadline with STATEMENT_TIMEOUT: 1 s + the 2 s margin.
SILENCE = 3.0


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
    """The deadline counts silence, not duration: without statement_timeout (as an online
    migration runs), rows of 64 kB every 0.5 s for 4.5 s come through; 4.5 s of
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
