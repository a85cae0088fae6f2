"""One PostgreSQL session mechanism for every store: connect, bound statements,
tell a lost session from a refused statement, and translate driver errors.

Driver exceptions never leave ``outbox.db``: ``Session.translated`` turns them into
``outbox.errors`` types (``DatabaseUnavailable`` when the session is gone,
``StatementTimedOut``, ``MissingPrivileges``, ``DatabaseRefused`` with the
server's first line otherwise).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import errors as pgerrors
from psycopg import pq
from psycopg.rows import dict_row

from outbox.db import privileges
from outbox.db.queries import Queries
from outbox.errors import (
    DatabaseRefused,
    DatabaseUnavailable,
    MissingPrivileges,
    OutboxError,
    StatementTimedOut,
)

Row = dict[str, Any]
Conn = psycopg.Connection[Row]


def connect(
    dsn: str,
    *,
    application_name: str,
    connect_timeout: float = 10.0,
    statement_timeout: float | None = None,
) -> Conn:
    """An autocommit connection, or ``DatabaseUnavailable`` saying what to check.

    With ``statement_timeout`` every statement of the session is bounded
    (``statement_timeout`` and ``lock_timeout``), and the server checks every
    ``CLIENT_CHECK_INTERVAL`` during a statement that the client is still there
    (``client_connection_check_interval``, PostgreSQL ≥ 14): a relay killed during
    a claim no longer leaves its backend running the claim, holding rows and CPU.
    """
    try:
        conn = psycopg.connect(
            dsn,
            autocommit=True,
            row_factory=dict_row,
            application_name=application_name,
            connect_timeout=max(1, round(connect_timeout)),
            # Notice a dead server or a cut network in seconds, not hours.
            keepalives=1,
            keepalives_idle=10,
            keepalives_interval=5,
            keepalives_count=3,
        )
    except psycopg.OperationalError as exc:
        reason = first_line(exc)
        raise DatabaseUnavailable(
            f"cannot connect to PostgreSQL: {reason}",
            "the server's certificate must be signed by the CA in sslrootcert= and name "
            "the DSN's host (sslmode=verify-full)"
            if "certificate" in reason
            else "check --dsn / OUTBOX_DSN and that the server is running",
        ) from exc
    if statement_timeout is not None:
        try:
            bound_statements(conn, statement_timeout)
        except psycopg.Error as exc:
            conn.close()
            raise DatabaseUnavailable(
                f"cannot configure the PostgreSQL session: {first_line(exc)}"
            ) from exc
    return conn


# How often a backend running one of our statements checks that we are still there.
CLIENT_CHECK_INTERVAL = "2s"


def bound_statements(conn: Conn, statement_timeout: float) -> None:
    millis = str(max(1, round(statement_timeout * 1000)))
    conn.execute("SELECT set_config('statement_timeout', %s, false)", [millis])
    conn.execute("SELECT set_config('lock_timeout', %s, false)", [millis])
    if conn.info.server_version >= 140000:
        conn.execute(
            "SELECT set_config('client_connection_check_interval', %s, false)",
            [CLIENT_CHECK_INTERVAL],
        )


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# SQLSTATEs that mean the session is gone (08: connection exception; 57P0x: the
# server is shutting down, crashed or not yet accepting connections).
_SESSION_GONE = ("08", "57P01", "57P02", "57P03")


def session_lost(conn: Conn, exc: Exception) -> bool:
    """Whether ``exc`` means the connection is gone (outcome of the statement unknown).

    Not every OperationalError: psycopg uses that class for class 53 (insufficient
    resources, e.g. "maximum number of prepared transactions reached"), 55P03 and
    57014 too, which leave the session alive and the statement certainly failed.
    """
    if conn.broken or conn.closed:
        return True
    if not isinstance(exc, psycopg.OperationalError):
        return False
    sqlstate = getattr(exc, "sqlstate", None)
    return sqlstate is None or sqlstate.startswith(_SESSION_GONE)


class Session:
    def __init__(
        self,
        dsn: str,
        table: str,
        application_name: str,
        connect_timeout: float,
        statement_timeout: float | None = None,
    ):
        self.table = table
        self.queries = Queries(table)
        self.statement_timeout = statement_timeout
        self.conn = connect(
            dsn,
            application_name=application_name,
            connect_timeout=connect_timeout,
            statement_timeout=statement_timeout,
        )

    @contextlib.contextmanager
    def _translated(self, what: str) -> Iterator[None]:
        try:
            yield
        except OutboxError:
            raise
        except psycopg.Error as exc:
            if session_lost(self.conn, exc):
                raise DatabaseUnavailable(
                    f"lost the PostgreSQL connection while {what}: {first_line(exc)}",
                    "the relay reconnects by itself; check the server if this repeats",
                ) from exc
            if self.conn.info.transaction_status != pq.TransactionStatus.IDLE:
                # The session lives: end any open claim so the retry starts clean.
                with contextlib.suppress(psycopg.Error):
                    self.conn.execute("ROLLBACK")
            if isinstance(exc, pgerrors.QueryCanceled | pgerrors.LockNotAvailable):
                raise StatementTimedOut(
                    f"PostgreSQL cancelled the statement {what} after "
                    f"{self.statement_timeout or 0:g} s ({first_line(exc)})",
                    "the relay retries with backoff; if this repeats, look for what "
                    "slows the server (pg_stat_activity) or raise --statement-timeout",
                ) from exc
            if isinstance(exc, pgerrors.InsufficientPrivilege):
                raise MissingPrivileges(
                    f"PostgreSQL refused {what}: {first_line(exc)}",
                    "grant the privileges listed in docs/reference/privileges.md",
                ) from exc
            if isinstance(exc, psycopg.OperationalError):
                raise DatabaseUnavailable(
                    f"PostgreSQL failed while {what}: {first_line(exc)}",
                    "the relay retries with backoff; check the server if this repeats",
                ) from exc
            # A constraint, a trigger, a value the server cannot store: a known
            # condition too, never a traceback (and the relay retries it).
            raise DatabaseRefused(
                f"PostgreSQL refused {what}: {first_line(exc)}",
                "look for a constraint or trigger added to the outbox tables; "
                "the relay retries with backoff",
            ) from exc

    def check_privileges(self, needs: privileges.Needs, who: str) -> None:
        """Raise ``MissingPrivileges`` with the GRANTs if the role lacks any of ``needs``.

        Tables that do not exist are left to the schema check that follows.
        """
        pairs = privileges.wanted(self.table, needs)
        with self._translated("checking privileges"):
            rows = self.conn.execute(
                self.queries["table_privileges"],
                {"tables": [t for t, _ in pairs], "privileges": [p for _, p in pairs]},
            ).fetchall()
        missing = [
            (r["table_name"], r["privilege"]) for r in rows if r["present"] and not r["granted"]
        ]
        if missing:
            role = rows[0]["role"]
            raise MissingPrivileges(
                f"the database role {role!r} lacks privileges {who} needs: "
                + ", ".join(f"{p} on {t}" for t, p in missing),
                "as the tables' owner, run: " + " ".join(privileges.grants(missing, role)),
            )

    def _missing(self, needs: privileges.Needs, who: str) -> MissingPrivileges | None:
        try:
            self.check_privileges(needs, who)
        except MissingPrivileges as exc:
            return exc
        return None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()

    @property
    def broken(self) -> bool:
        return self.conn.broken or self.conn.closed
