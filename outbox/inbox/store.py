"""The consumer's inbox in its own PostgreSQL database (psycopg 3).

``InboxStore`` owns one connection.  ``apply`` is the exactly-once step: in ONE
transaction it records the message id in the inbox and runs the handler's effect,
then commits; the caller acks only after that.  The id is the primary key, so a
second copy of a message, delivered before or after the commit, finds it and
changes nothing.  A crash anywhere before the COMMIT loses the whole transaction
(the message comes back and is applied then); a crash after it leaves the id, so
the redelivered message is skipped.

``record_failure`` counts a failed attempt and parks the message once it has
failed ``max_attempts`` times, in the same transaction that also records its id,
so a parked message is never applied later by a stray copy.  ``take_parked`` is
the first half of ``outbox parked retry`` (see ``outbox.inbox.parked``).

The tables are created at start-up (``ensure_schema``) under an advisory lock, the
way ``outbox init`` migrates the outbox: the consumer's database is not the
outbox's, so this is not an outbox migration.
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from outbox.db.queries import load_blocks
from outbox.errors import DatabaseUnavailable, OutboxError, SchemaNotReady

DEFAULT_INBOX_TABLE = "outbox_inbox"

# Advisory-lock class of ``ensure_schema``; distinct from migrate's and the relays'.
SCHEMA_LOCK_CLASS = 0x6F6269

# SQLSTATE classes that mean the session is gone (as in ``outbox.db.session``).
_SESSION_GONE = ("08", "57P01", "57P02", "57P03")

Effect = Callable[["psycopg.Connection[Any]"], None]


def inbox_identifiers(table: str) -> dict[str, sql.Identifier]:
    return {
        "inbox": sql.Identifier(table),
        "inbox_by_age": sql.Identifier(f"{table}_by_age"),
        "attempts": sql.Identifier(f"{table}_attempts"),
        "parked": sql.Identifier(f"{table}_parked"),
    }


def _statements(table: str) -> dict[str, sql.Composed]:
    ids = inbox_identifiers(table)
    return {
        name: sql.SQL(body).format(**ids)
        for name, body in load_blocks("outbox.inbox", "inbox.sql").items()
    }


def render_sql(table: str) -> str:
    """The inbox tables as one script (``outbox consume --print-sql``)."""
    schema = _statements(table)["schema"].as_string(None)
    return f"-- outbox consume: inbox tables {table!r}\nBEGIN;\n{schema}\nCOMMIT;\n"


class HandlerFailed(Exception):
    """The handler raised (or broke the transaction): the message's effect failed."""

    def __init__(self, error: BaseException, description: str) -> None:
        super().__init__(description)
        self.error = error
        self.description = description


@dataclasses.dataclass(frozen=True)
class Failure:
    """What ``record_failure`` did: ``parked`` or not, after ``attempts`` attempts;
    ``duplicate`` if another copy of the message was applied meanwhile."""

    attempts: int
    parked: bool
    duplicate: bool = False


@dataclasses.dataclass(frozen=True)
class Parking:
    """Everything kept about a parked message, enough to publish it again."""

    message_id: str | None
    queue: str
    exchange: str
    routing_key: str
    body: bytes
    headers: dict[str, Any]
    properties: dict[str, Any]
    error: str


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def describe(exc: BaseException) -> str:
    """One line for logs and the parked table: type, message, and where it was raised."""
    where = ""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None:
        where = f" ({tb.tb_frame.f_code.co_filename}:{tb.tb_lineno})"
    return f"{type(exc).__name__}: {_first_line(exc)}{where}"


def connect(dsn: str, *, application_name: str, connect_timeout: float) -> psycopg.Connection[Any]:
    """An autocommit connection with psycopg's default (tuple) rows, as handlers expect."""
    try:
        return psycopg.connect(
            dsn,
            autocommit=True,
            application_name=application_name,
            connect_timeout=max(1, round(connect_timeout)),
            keepalives=1,
            keepalives_idle=10,
            keepalives_interval=5,
            keepalives_count=3,
        )
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(
            f"cannot connect to the consumer's PostgreSQL: {_first_line(exc)}",
            "check --dsn / OUTBOX_DSN and that the server is running",
        ) from exc


class InboxStore:
    def __init__(
        self,
        dsn: str,
        table: str,
        consumer: str,
        *,
        application_name: str = "outbox-consume",
        connect_timeout: float = 10.0,
    ) -> None:
        self.table = table
        self.consumer = consumer
        self.queries = _statements(table)
        self.conn = connect(dsn, application_name=application_name, connect_timeout=connect_timeout)

    @property
    def broken(self) -> bool:
        return self.conn.broken or self.conn.closed

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()

    def _lost(self, exc: BaseException) -> bool:
        if self.broken:
            return True
        if not isinstance(exc, psycopg.OperationalError):
            return False
        sqlstate = getattr(exc, "sqlstate", None)
        return sqlstate is None or sqlstate.startswith(_SESSION_GONE)

    @contextlib.contextmanager
    def _translated(self, what: str) -> Iterator[None]:
        try:
            yield
        except (OutboxError, HandlerFailed):
            raise
        except psycopg.Error as exc:
            if self._lost(exc):
                raise DatabaseUnavailable(
                    f"lost the consumer's PostgreSQL connection while {what}: {_first_line(exc)}",
                    "the consumer reconnects by itself; check the server if this repeats",
                ) from exc
            if isinstance(exc, psycopg.OperationalError):
                # Transient trouble on a live session (resources, lock timeout).
                raise DatabaseUnavailable(
                    f"PostgreSQL failed while {what}: {_first_line(exc)}",
                    "the consumer retries with backoff; check the server if this repeats",
                ) from exc
            raise OutboxError(
                f"PostgreSQL failed while {what}: {_first_line(exc)}",
                "check the inbox tables (outbox consume --print-sql) and the role's rights",
            ) from exc

    def _params(self, **values: Any) -> dict[str, Any]:
        return {"consumer": self.consumer, **values}

    # -- set-up ---------------------------------------------------------------
    def ensure_schema(self) -> None:
        """Create the inbox tables if missing; concurrent consumers wait on one lock."""
        with self._translated("creating the inbox tables"), self.conn.transaction():
            self.conn.execute(
                "SELECT pg_advisory_xact_lock(%s, %s)",
                [SCHEMA_LOCK_CLASS, zlib.crc32(self.table.encode()) & 0x7FFFFFFF],
            )
            self.conn.execute(self.queries["schema"])

    # -- messages -------------------------------------------------------------------
    def apply(self, message_id: str, effect: Effect, *, had_failed: bool) -> bool:
        """Record ``message_id`` and run ``effect`` in one transaction; False: duplicate.

        ``had_failed``: the message may have failed before (it was redelivered), so
        its attempt counter is cleared in the same transaction.  Raises
        ``HandlerFailed`` (rolled back) or ``DatabaseUnavailable`` (outcome of the
        commit unknown: process the message again after reconnecting, the inbox
        knows).
        """
        return self.apply_many([(message_id, effect, had_failed)])[0]

    def apply_many(self, items: Sequence[tuple[str, Effect, bool]]) -> list[bool]:
        """``apply`` for several messages in ONE transaction (one commit for all):
        all their effects and ids commit together, or none.  Raises like ``apply``
        if any effect fails; the caller then applies them one by one."""
        applied = []
        ids = [message_id for message_id, _, _ in items]
        try:
            with self.conn.transaction():
                cur = self.conn.execute(self.queries["record_messages"], self._params(ids=ids))
                new = {row[0] for row in cur.fetchall()}
                failed_before = [m for m, _, had_failed in items if had_failed and m in new]
                if failed_before:
                    self.conn.execute(
                        self.queries["forget_attempts_of"], self._params(ids=failed_before)
                    )
                for message_id, effect, _ in items:
                    if message_id not in new:
                        applied.append(False)  # a copy was applied before, or earlier here
                        continue
                    new.discard(message_id)
                    try:
                        effect(self.conn)
                    except Exception as exc:
                        if self._lost(exc):
                            raise
                        raise HandlerFailed(exc, describe(exc)) from exc
                    self._check_still_in_transaction()
                    applied.append(True)
        except HandlerFailed:
            if self.broken:
                raise DatabaseUnavailable(
                    "lost the consumer's PostgreSQL connection while applying messages",
                    "the consumer reconnects by itself; check the server if this repeats",
                ) from None
            raise
        except psycopg.Error as exc:
            if self._lost(exc):
                raise DatabaseUnavailable(
                    "lost the consumer's PostgreSQL connection while applying messages: "
                    f"{_first_line(exc)}",
                    "the consumer reconnects by itself; the inbox decides when they come back",
                ) from exc
            # The COMMIT refused an effect (a deferred constraint, a serialization
            # failure), or two consumers' batches deadlocked on their ids: the
            # transaction failed, like a raise inside a handler.
            raise HandlerFailed(exc, describe(exc)) from exc
        return applied

    def _check_still_in_transaction(self) -> None:
        """psycopg "commits" an aborted transaction without an error (the server just
        rolls back): a handler that caught a database error must not be acked."""
        status = self.conn.info.transaction_status
        if status == TransactionStatus.INERROR:
            error = RuntimeError(
                "the handler caught a database error; its transaction was aborted and "
                "cannot commit (let the error propagate, or use conn.transaction() as a "
                "savepoint around the statement that may fail)"
            )
        elif status != TransactionStatus.INTRANS:
            error = RuntimeError(
                "the handler ended the transaction itself (commit or rollback); it must "
                "leave that to the consumer (use conn.transaction() for savepoints)"
            )
        else:
            return
        raise HandlerFailed(error, describe(error))

    def record_failure(
        self, message_id: str, error: str, *, max_attempts: int, parking: Parking
    ) -> Failure:
        """Count a failed attempt; at ``max_attempts`` park the message (its id goes
        into the inbox in the same transaction, so no later copy applies it)."""
        params = self._params(message_id=message_id)
        with self._translated("recording a failed attempt"), self.conn.transaction():
            row = self.conn.execute(
                self.queries["count_attempt"], {**params, "error": error}
            ).fetchone()
            attempts = int(row[0]) if row else 1
            if attempts < max_attempts:
                return Failure(attempts, parked=False)
            if self.conn.execute(self.queries["record_message"], params).rowcount == 0:
                # Another copy was applied since: nothing to park, the effect exists.
                self.conn.execute(self.queries["forget_attempts"], params)
                return Failure(attempts, parked=False, duplicate=True)
            self._park(parking, attempts)
            self.conn.execute(self.queries["forget_attempts"], params)
        return Failure(attempts, parked=True)

    def park(self, parking: Parking) -> None:
        """Park a message that cannot be handled at all (no message id)."""
        with self._translated("parking a message"), self.conn.transaction():
            self._park(parking, attempts=0)

    def _park(self, parking: Parking, attempts: int) -> None:
        self.conn.execute(
            self.queries["park_message"],
            self._params(
                message_id=parking.message_id,
                queue=parking.queue,
                exchange=parking.exchange,
                routing_key=parking.routing_key,
                body=parking.body,
                headers=Jsonb(parking.headers),
                properties=Jsonb(parking.properties),
                error=parking.error,
                attempts=attempts,
            ),
        )

    # -- retention --------------------------------------------------------------
    def prune(self, retention_seconds: float, *, batch: int = 1000, max_batches: int = 10) -> int:
        """Delete inbox ids older than the retention window, ``batch`` rows per
        transaction, at most ``max_batches`` batches per call; returns how many."""
        params = self._params(retention=retention_seconds, batch=batch)
        deleted = 0
        with self._translated("pruning the inbox"):
            for _ in range(max_batches):
                count = self.conn.execute(self.queries["prune_inbox"], params).rowcount
                deleted += count
                if count < batch:
                    break
            self.conn.execute(self.queries["prune_attempts"], params)
        return deleted

    # -- figures ------------------------------------------------------------------
    def parked_count(self) -> int:
        with self._translated("counting parked messages"):
            row = self.conn.execute(self.queries["parked_count"], self._params()).fetchone()
        return int(row[0]) if row else 0


class ParkedStore(InboxStore):
    """What ``outbox parked`` reads and changes (any consumer's rows in the table)."""

    def __init__(self, dsn: str, table: str, *, connect_timeout: float = 10.0) -> None:
        super().__init__(
            dsn, table, "", application_name="outbox-parked", connect_timeout=connect_timeout
        )
        with self._translated("looking for the inbox tables"):
            row = self.conn.execute("SELECT to_regclass(%s) IS NOT NULL", [f"{table}_parked"])
            found = row.fetchone()
        if not found or not found[0]:
            self.close()
            raise SchemaNotReady(
                f"the inbox table {table}_parked does not exist in this database",
                "check --dsn and --inbox-table; `outbox consume` creates it at start-up "
                "(or apply `outbox consume --print-sql`)",
            )

    def entries(self, limit: int) -> list[dict[str, Any]]:
        with self._translated("listing parked messages"):
            cur = self.conn.cursor(row_factory=dict_row)
            return cur.execute(self.queries["list_parked"], {"limit": limit}).fetchall()

    def entry(self, parked_id: int) -> dict[str, Any] | None:
        """One parked message with its body, headers and properties (JSON text)."""
        with self._translated("reading a parked message"):
            cur = self.conn.cursor(row_factory=dict_row)
            return cur.execute(self.queries["parked_message"], {"id": parked_id}).fetchone()

    def matching(self, ids: Sequence[str]) -> list[dict[str, Any]]:
        """The parked messages ``taking(ids)`` or ``purge(ids)`` would take now."""
        with self._translated("selecting parked messages"):
            cur = self.conn.cursor(row_factory=dict_row)
            return cur.execute(self.queries["select_parked"], {"ids": list(ids)}).fetchall()

    @contextlib.contextmanager
    def taking(self, ids: Sequence[str] | None, limit: int) -> Iterator[list[dict[str, Any]]]:
        """Remove up to ``limit`` parked messages (``ids`` None: any) with their inbox
        ids, and yield them; commit when the block ends, roll back if it raises."""
        with self._translated("taking parked messages"), self.conn.transaction():
            cur = self.conn.cursor(row_factory=dict_row)
            rows = cur.execute(
                self.queries["take_parked"],
                {"all": ids is None, "ids": list(ids or []), "limit": limit},
            ).fetchall()
            yield rows

    def purge(self, ids: Sequence[str] | None, older_than: float | None) -> int:
        with self._translated("purging parked messages"):
            cur = self.conn.execute(
                self.queries["purge_parked"],
                {"all": ids is None, "ids": list(ids or []), "older_than": older_than},
            )
            return cur.rowcount
