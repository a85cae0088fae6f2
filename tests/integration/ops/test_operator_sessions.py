"""Issue 30, item 1 and issue 31, item 3: every database session of every command an
operator runs has a ``statement_timeout`` and a ``lock_timeout``, and a client
deadline (``outbox.db.session.DeadlineConnection``): a PostgreSQL that stops answering
cannot hang the command where the server's timeouts never answer.

The commands are walked from the click group itself, so a command added later is
covered (or must be named among the exclusions, with why).  Each one runs in this
process against a real database; every connection it opens (``psycopg.connect`` or
a ``psycopg.Connection`` subclass's ``connect``, which ``outbox.db.session.connect``
wraps) is asked for its settings just before it is closed (or at the end, if never
closed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import click
import psycopg
import pytest

import outbox.web.server
from outbox.cli import cli, main
from outbox.db.inbox import InboxStore
from outbox.web import console
from tests.fixtures.servers import Topology

INBOX = "inbox"

# Arguments that make each operator command do its work (and open its sessions).
OPERATOR_COMMANDS: dict[tuple[str, ...], list[str]] = {
    ("init",): [],
    ("status",): [],
    ("resolve",): [],
    ("dead-letters", "list"): [],
    ("dead-letters", "retry"): ["--all"],
    ("dead-letters", "purge"): ["--all"],
    ("parked", "list"): [],
    ("parked", "retry"): ["--all"],
    ("parked", "purge"): ["--all"],
    ("web",): ["--inbox-table", INBOX],
}
# Not operator tools: daemons with their own bounds (the relay: --statement-timeout
# on every session; the consumer: a lock_timeout, no statement_timeout, for its
# handlers' sake), and the demo and benchmark harnesses.
NOT_OPERATOR_TOOLS = {"relay", "consume", "demo", "bench"}


def leaves(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from leaves(command, (*path, name))
        else:
            yield (*path, name)


def test_every_operator_command_is_walked() -> None:
    walked = {c for c in leaves(cli) if c[0] not in NOT_OPERATOR_TOOLS}
    assert walked == set(OPERATOR_COMMANDS), "name each new command's arguments here"


class Sessions:
    """Every connection opened meanwhile, with its bounds as read before it closed."""

    def __init__(self) -> None:
        self.opened: list[psycopg.Connection[Any]] = []
        self.bounds: dict[int, tuple[str, str]] = {}
        # Each session's client deadline (``DeadlineConnection.silence``), read with
        # its bounds: None for a session without one.
        self.deadlines: dict[int, float | None] = {}

    def read(self, conn: psycopg.Connection[Any]) -> None:
        if id(conn) in self.bounds or conn.closed or conn.broken:
            return
        self.deadlines[id(conn)] = getattr(conn, "silence", None)
        try:
            cur = conn.cursor(row_factory=psycopg.rows.tuple_row)
            row = cur.execute(
                "SELECT current_setting('statement_timeout'), current_setting('lock_timeout')"
            ).fetchone()
            assert row is not None
            self.bounds[id(conn)] = (str(row[0]), str(row[1]))
        except psycopg.Error as exc:
            self.bounds[id(conn)] = (f"unreadable: {exc}", "")

    def unbounded(self) -> list[tuple[str, str]]:
        for conn in self.opened:
            self.read(conn)
        return [b for b in self.bounds.values() if "0" in b or b[0].startswith("unreadable")]

    def without_deadline(self) -> list[str]:
        """The sessions (their bounds) with no client deadline."""
        for conn in self.opened:
            self.read(conn)
        return [str(self.bounds[k]) for k, silence in self.deadlines.items() if silence is None]


@contextlib.contextmanager
def watching(monkeypatch: pytest.MonkeyPatch) -> Iterator[Sessions]:
    sessions = Sessions()
    connect, close = psycopg.connect, psycopg.Connection.close
    # Connection.connect as a function: also what subclasses (DeadlineConnection) call.
    class_connect = psycopg.Connection.connect.__func__  # type: ignore[attr-defined]

    def connecting(*args: Any, **kwargs: Any) -> Any:
        conn = connect(*args, **kwargs)
        sessions.opened.append(conn)
        return conn

    def class_connecting(cls: type[psycopg.Connection[Any]], *args: Any, **kwargs: Any) -> Any:
        conn = class_connect(cls, *args, **kwargs)
        sessions.opened.append(conn)
        return conn

    def closing(self: psycopg.Connection[Any]) -> None:
        if any(self is c for c in sessions.opened):
            sessions.read(self)
        close(self)

    with monkeypatch.context() as patched:
        patched.setattr(psycopg, "connect", connecting)
        patched.setattr(psycopg.Connection, "connect", classmethod(class_connecting))
        patched.setattr(psycopg.Connection, "close", closing)
        yield sessions


def exercise_console(config: Any, port: int) -> None:
    """``outbox web`` without serving: what its pages and actions call."""
    settings = config.console.outboxes[0]
    [inbox] = config.console.inboxes
    console.overview(config.console)
    console.plan_dead_letters(settings, console.DeadLetterSelection(row_ids=(1,)))
    console.retry_dead_letters(settings, console.DeadLetterSelection(row_ids=(1,)))
    console.purge_parked(inbox, ["none"])
    console.retry_parked(inbox, config.amqp_url, ["none"])
    console.resolve_pass(settings, dry_run=True)


@pytest.mark.parametrize("command", sorted(OPERATOR_COMMANDS), ids=" ".join)
def test_operator_command__every_session_has_statement_and_lock_timeouts_and_a_deadline(
    command: tuple[str, ...],
    dsn: str,
    topology: Topology,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = InboxStore(dsn, INBOX, "c")
    try:
        store.ensure_schema()
    finally:
        store.close()
    monkeypatch.setenv("OUTBOX_DSN", dsn)
    monkeypatch.setenv("OUTBOX_AMQP_URL", topology.amqp_url)
    monkeypatch.setenv("OUTBOX_LEDGER_QUEUE", topology.ledger)
    monkeypatch.setenv("OUTBOX_INBOX_TABLE", INBOX)
    monkeypatch.setattr(outbox.web.server, "serve", exercise_console)
    with watching(monkeypatch) as sessions, pytest.raises(SystemExit) as exited:
        main([*command, *OPERATOR_COMMANDS[command]])
    assert exited.value.code in (0, 1), exited.value.code  # 1: status' "attention"
    assert sessions.opened, "the command opened no session: its arguments do no work"
    assert sessions.unbounded() == []
    assert sessions.without_deadline() == []
