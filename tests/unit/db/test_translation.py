"""One translation of driver errors for every store (``outbox.db.session.translated``):
the relay's sessions and the consumer's inbox store both go through it."""

from __future__ import annotations

from dataclasses import dataclass, field

import psycopg
import pytest
from psycopg import errors as pgerrors
from psycopg import pq

from outbox.db.inbox import InboxStore, StatementRefused
from outbox.db.session import Hints, translated
from outbox.errors import (
    DatabaseRefused,
    DatabaseUnavailable,
    MissingPrivileges,
    OutboxError,
    StatementTimedOut,
)


@dataclass
class Info:
    transaction_status: pq.TransactionStatus = pq.TransactionStatus.INERROR


@dataclass
class FakeConn:
    """A live session whose last statement failed inside a transaction."""

    broken: bool = False
    closed: bool = False
    info: Info = field(default_factory=Info)
    executed: list[str] = field(default_factory=list)

    def execute(self, statement: str) -> None:
        self.executed.append(statement)


def raised(error: Exception, **options: object) -> tuple[OutboxError, FakeConn]:
    conn = FakeConn()
    with pytest.raises(OutboxError) as caught, translated(conn, "claiming", **options):  # type: ignore[arg-type]
        raise error
    return caught.value, conn


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (pgerrors.QueryCanceled("canceling statement due to statement timeout"), StatementTimedOut),
        (pgerrors.LockNotAvailable("lock timeout"), StatementTimedOut),
        (pgerrors.InsufficientPrivilege("permission denied"), MissingPrivileges),
        (pgerrors.DiskFull("no space"), DatabaseUnavailable),
        (pgerrors.UniqueViolation("duplicate key"), DatabaseRefused),
    ],
)
def test_translated__a_live_session_ends_its_transaction_and_says_what_failed(
    error: psycopg.Error, expected: type[OutboxError]
) -> None:
    translated_error, conn = raised(error, statement_timeout=2.0)
    assert type(translated_error) is expected
    assert "claiming" in translated_error.message
    assert conn.executed == ["ROLLBACK"]


def test_translated__a_refusal_becomes_what_the_store_says() -> None:
    def refused(what: str, exc: Exception) -> OutboxError:
        return StatementRefused(f"refused {what}")

    for error in (pgerrors.InsufficientPrivilege("no"), pgerrors.UniqueViolation("no")):
        translated_error, _ = raised(error, hints=Hints.daemon("consumer"), refused=refused)
        assert type(translated_error) is StatementRefused
    # Timeouts and failures of the server stay the mechanism's own.
    translated_error, _ = raised(
        pgerrors.QueryCanceled("x"), hints=Hints.daemon("consumer"), refused=refused
    )
    assert type(translated_error) is StatementTimedOut
    assert "the consumer retries" in translated_error.hint


def test_translated__an_operators_hints_say_to_run_the_command_again() -> None:
    """``outbox parked`` and ``dead-letters`` (``Hints.operator``): no daemon named, the
    command's own word on a lost session; a lock wait still names what held it."""
    hints = Hints.operator("nothing is lost: run the command again")
    for error in (
        pgerrors.QueryCanceled("x"),
        pgerrors.DiskFull("no space"),
        pgerrors.UniqueViolation("x"),
    ):
        translated_error, _ = raised(error, hints=hints)
        assert "retries with backoff" not in translated_error.hint, translated_error.hint
    slow, _ = raised(pgerrors.QueryCanceled("x"), hints=hints)
    assert slow.hint.startswith("run the command again;"), slow.hint
    failed, _ = raised(pgerrors.DiskFull("no space"), hints=hints)
    assert failed.hint.startswith("run the command again;"), failed.hint
    lock, _ = raised(pgerrors.LockNotAvailable("lock timeout"), hints=hints)
    assert lock.hint.startswith("try again"), lock.hint


def test_inbox_store__translates_through_the_one_mechanism() -> None:
    """Before, the store had a copy of its own: a cancelled statement was a plain
    ``DatabaseUnavailable`` ("PostgreSQL failed while …")."""
    store = InboxStore.__new__(InboxStore)
    store.conn = FakeConn()  # type: ignore[assignment]
    store.table, store.statement_timeout, store.lock_timeout = "inbox", None, 5.0
    with pytest.raises(StatementTimedOut), store._translated("recording message ids"):
        raise pgerrors.QueryCanceled("canceling statement due to user request")
    with pytest.raises(StatementRefused), store._translated("committing"):
        raise pgerrors.CheckViolation("violates check constraint")
    store.conn.broken = True  # type: ignore[attr-defined]
    lost = pytest.raises(DatabaseUnavailable, match="lost the PostgreSQL connection")
    with lost, store._translated("committing"):
        raise psycopg.OperationalError("server closed the connection")
