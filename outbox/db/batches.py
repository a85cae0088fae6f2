"""The only module that talks to PostgreSQL (psycopg 3).

Two kinds of session:

- ``BatchStore``: the relay's work connection.  It claims rows, prepares and
  finishes batches.  It runs in autocommit mode and issues BEGIN / PREPARE
  TRANSACTION / COMMIT PREPARED itself, so that a prepared batch never pins the
  connection's transaction state.
- ``ControlSession``: one small autocommit session per relay that holds the relay's
  advisory lock (proof of life for resolvers), writes its heartbeat and LISTENs for
  wake-ups.  It never takes part in a batch, because a transaction that ran LISTEN
  cannot be prepared.

Driver exceptions never leave this module: they become ``outbox.errors`` types.
A lost connection during PREPARE or COMMIT/ROLLBACK PREPARED raises
``OutcomeUnknown``: the caller must look the gid up after reconnecting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import os
import socket
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
from psycopg import errors as pgerrors
from psycopg import sql
from psycopg.adapt import Dumper, Loader, PyFormat
from psycopg.pq import Format
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from outbox import gid as gids
from outbox.db import migrate, privileges
from outbox.db.queries import Queries
from outbox.db.replication import Replication
from outbox.errors import (
    DatabaseUnavailable,
    DeadLettersUnwritable,
    MissingPrivileges,
    OutboxError,
    OutcomeUnknown,
    PreparedSlotsExhausted,
    PreparedTransactionsDisabled,
    StatementTimedOut,
)
from outbox.message import EPOCH, DeadLetter, OutboxRow, Unloadable

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
        reason = _first_line(exc)
        raise DatabaseUnavailable(
            f"cannot connect to PostgreSQL: {reason}",
            "the server's certificate must be signed by the CA in sslrootcert= and name "
            "the DSN's host (sslmode=verify-full)"
            if "certificate" in reason
            else "check --dsn / OUTBOX_DSN and that the server is running",
        ) from exc
    if statement_timeout is not None:
        try:
            _bound_statements(conn, statement_timeout)
        except psycopg.Error as exc:
            conn.close()
            raise DatabaseUnavailable(
                f"cannot configure the PostgreSQL session: {_first_line(exc)}"
            ) from exc
    return conn


# How many keyed rows, in batches, a claim looks at from the front of the outbox to
# find the keys it may take (``queries.sql``, ``claim_batch``).  Rows of keys held by
# other batches count too: a key with a larger backlog than this delays the keys
# behind it until it drains (README, "Per-key ordering").
KEYED_WINDOW = 5

# The claim's plan must not depend on the statistics (``queries.sql``,
# ``claim_batch``): a table analyzed while nearly empty made the planner read the
# whole table, in a sequential scan and a sort, to find the front of the keyed rows.
# Sent with the claim's BEGIN (no extra round trip); it ends with the transaction.
PINNED_CLAIM_PLAN = "SET LOCAL enable_seqscan = off"

# How often a backend running one of our statements checks that we are still there.
CLIENT_CHECK_INTERVAL = "2s"


def _bound_statements(conn: Conn, statement_timeout: float) -> None:
    millis = str(max(1, round(statement_timeout * 1000)))
    conn.execute("SELECT set_config('statement_timeout', %s, false)", [millis])
    conn.execute("SELECT set_config('lock_timeout', %s, false)", [millis])
    if conn.info.server_version >= 140000:
        conn.execute(
            "SELECT set_config('client_connection_check_interval', %s, false)",
            [CLIENT_CHECK_INTERVAL],
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# SQLSTATEs that mean the session is gone (08: connection exception; 57P0x: the
# server is shutting down, crashed or not yet accepting connections).
_SESSION_GONE = ("08", "57P01", "57P02", "57P03")


def _lost(conn: Conn, exc: Exception) -> bool:
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


def _row(record: Row) -> OutboxRow:
    """An OutboxRow from a claimed record; never raises (see ``_claim_cursor``)."""
    unloadable = {
        column: value
        for column in ("created_at", "headers")
        if isinstance(value := record[column], Unloadable)
    }
    return OutboxRow(
        id=record["id"],
        message_id=record["message_id"],
        exchange=record["exchange"],
        routing_key=record["routing_key"],
        payload=record["payload"],  # a view of the driver's result: no copy
        headers=None if "headers" in unloadable else record["headers"],
        content_type=record["content_type"],
        created_at=EPOCH if "created_at" in unloadable else record["created_at"],
        unloadable=unloadable,
        ordering_key=record["ordering_key"],
        held_by=record["held_by"],
    )


@dataclasses.dataclass(frozen=True)
class _Unloaded:
    """A binary value Python could not load, as PostgreSQL sent it (``raw``);
    ``_with_texts`` asks the server for its text, which the dead letter keeps."""

    oid: int
    raw: bytes
    error: str


class _TolerantLoader(Loader):
    """Loads like ``inner``, but a value it cannot load becomes ``_Unloaded``.

    psycopg raises DataError for timestamps Python cannot hold ('infinity',
    '-infinity', BC, after year 9999) and the JSON loader RecursionError for
    deep nesting, in the middle of fetching a batch: one such row would stop the
    relay on every start.  The row becomes a dead letter instead.
    """

    inner: type[Loader]
    format = Format.BINARY

    def __init__(self, oid: int, context: Any = None) -> None:
        super().__init__(oid, context)
        self._inner = self.inner(oid, context)

    def load(self, data: Any) -> Any:
        try:
            return self._inner.load(data)
        except (psycopg.DataError, ValueError, OverflowError, RecursionError) as exc:
            return _Unloaded(self.oid, bytes(data), _first_line(exc))


@functools.cache
def _tolerant(inner: type[Loader]) -> type[Loader]:
    return type(f"Tolerant{inner.__name__}", (_TolerantLoader,), {"inner": inner})


class _PayloadLoader(Loader):
    """bytea as a read-only view of the driver's result, not a copy of it.

    The view keeps the result alive (psycopg's C implementation hands Python
    loaders a memoryview that holds a reference to the PGresult); the pure-Python
    implementation hands over bytes, which are returned as they are.
    """

    format = Format.BINARY

    def load(self, data: Any) -> Any:
        return data


class _RawDumper(Dumper):
    """Sends an ``_Unloaded`` value back in the binary form PostgreSQL sent it."""

    format = Format.BINARY

    def dump(self, obj: Any) -> bytes:
        return bytes(obj.raw)

    def get_key(self, obj: Any, format: PyFormat) -> Any:
        return (type(self), obj.oid)

    def upgrade(self, obj: Any, format: PyFormat) -> Dumper:
        dumper = type(self)(type(obj))
        dumper.connection, dumper.oid = self.connection, obj.oid
        return dumper


def _claim_cursor(conn: Conn) -> psycopg.Cursor[Row]:
    """A binary cursor: a payload arrives as its bytes, not as hex text twice its
    size (plus a decoded copy), and stays in the driver's result (``_PayloadLoader``).

    timestamptz and jsonb values that cannot be loaded come back as ``_Unloaded``
    instead of failing the whole fetch.
    """
    cur = conn.cursor(binary=True)
    for type_name in ("timestamptz", "jsonb"):
        info = cur.adapters.types[type_name]
        inner = cur.adapters.get_loader(info.oid, Format.BINARY)
        if inner is not None and not issubclass(inner, _TolerantLoader):
            cur.adapters.register_loader(info.oid, _tolerant(inner))
    cur.adapters.register_loader("bytea", _PayloadLoader)
    return cur


def _with_texts(conn: Conn, records: list[Row]) -> list[Row]:
    """Replace each ``_Unloaded`` value by an ``Unloadable`` holding PostgreSQL's own
    text of it (one round trip per such value; only bad rows have any)."""
    for record in records:
        for column, value in record.items():
            if isinstance(value, _Unloaded):
                cur = conn.cursor()
                cur.adapters.register_dumper(_Unloaded, _RawDumper)
                row = cur.execute("SELECT %b::text AS text", [value]).fetchone()
                text = row["text"] if row else ""
                record[column] = Unloadable(text, value.error)
    return records


@dataclasses.dataclass(frozen=True)
class PreparedBatch:
    """A row of ``pg_prepared_xacts``."""

    gid: str
    prepared: datetime.datetime
    owner: str
    local: bool  # in the current database
    age_seconds: float


@dataclasses.dataclass(frozen=True)
class RelayLiveness:
    relay_id: str
    lock_held: bool
    heartbeat_age: float | None  # None: the relay never registered or was forgotten
    backend_pid: int | None


class _Session:
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
            if _lost(self.conn, exc):
                raise DatabaseUnavailable(
                    f"lost the PostgreSQL connection while {what}: {_first_line(exc)}",
                    "the relay reconnects by itself; check the server if this repeats",
                ) from exc
            if isinstance(exc, psycopg.OperationalError | pgerrors.InsufficientPrivilege):
                # Transient trouble on a live session (resources, lock timeout), or
                # a privilege revoked: end any open claim so the retry starts clean.
                with contextlib.suppress(psycopg.Error):
                    self.conn.execute("ROLLBACK")
            if isinstance(exc, pgerrors.QueryCanceled | pgerrors.LockNotAvailable):
                raise StatementTimedOut(
                    f"PostgreSQL cancelled the statement {what} after "
                    f"{self.statement_timeout or 0:g} s ({_first_line(exc)})",
                    "the relay retries with backoff; if this repeats, look for what "
                    "slows the server (pg_stat_activity) or raise --statement-timeout",
                ) from exc
            if isinstance(exc, pgerrors.InsufficientPrivilege):
                raise MissingPrivileges(
                    f"PostgreSQL refused {what}: {_first_line(exc)}",
                    "grant the privileges listed in README.md, 'Privileges'",
                ) from exc
            if isinstance(exc, psycopg.OperationalError):
                raise DatabaseUnavailable(
                    f"PostgreSQL failed while {what}: {_first_line(exc)}",
                    "the relay retries with backoff; check the server if this repeats",
                ) from exc
            raise

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


def _dead_letter_params(letter: DeadLetter, gid: str) -> dict[str, Any]:
    row = letter.row
    headers: Any = Jsonb(row.headers) if row.headers is not None else None
    created_at: Any = row.created_at
    # A value Python could not load goes back as PostgreSQL's own text of it.
    if "headers" in row.unloadable:
        headers = row.unloadable["headers"].text
    if "created_at" in row.unloadable:
        created_at = row.unloadable["created_at"].text
    return {
        "id": row.id,
        "message_id": row.message_id,
        "exchange": row.exchange,
        "routing_key": row.routing_key,
        "payload": row.payload,
        "headers": headers,
        "content_type": row.content_type,
        "created_at": created_at,
        "ordering_key": row.ordering_key,
        # PostgreSQL text cannot hold NUL; a reason quotes broker and row text.
        "reason": letter.reason.replace("\x00", "\\0"),
        "gid": gid,
    }


class BatchStore(_Session):
    """Claims, prepares and finishes batches on the relay's work connection."""

    def __init__(
        self,
        dsn: str,
        table: str,
        *,
        application_name: str = "outbox-relay",
        connect_timeout: float = 10.0,
        statement_timeout: float | None = None,
    ) -> None:
        super().__init__(dsn, table, application_name, connect_timeout, statement_timeout)

    # -- preflight ---------------------------------------------------------
    def check_ready(self) -> None:
        """Raise if prepared transactions are disabled, the schema is not current
        (missing, older, or newer than this code), or the role lacks a privilege
        the relay needs."""
        with self._translated("checking the database"):
            slots = self.conn.execute(self.queries["max_prepared_transactions"]).fetchone()
            if not slots or slots["slots"] <= 0:
                raise PreparedTransactionsDisabled(
                    "PostgreSQL has prepared transactions disabled (max_prepared_transactions = 0)",
                    "set max_prepared_transactions to at least twice the number of relays "
                    "(e.g. 64) in postgresql.conf and restart PostgreSQL",
                )
        self.check_privileges(privileges.RELAY, "the relay")
        with self._translated("checking the database"):
            version = migrate.current_version(self.conn, self.table)
        migrate.require_current(version, self.table)

    # -- the batch ---------------------------------------------------------
    def claim_batch(
        self,
        limit: int,
        max_bytes: int = 2**62,
        *,
        hold_keys: bool = True,
        own: Sequence[int] = (),
    ) -> list[OutboxRow]:
        """Open a transaction and claim up to ``limit`` rows (deleted, locked), stopping
        once ``max_bytes`` of payload are in (the first row always comes); in id order.

        Rows with an ordering key come as a prefix of their key (``queries.sql``,
        ``claim_batch``); with ``hold_keys`` a row behind a dead letter of its key
        says so (``OutboxRow.held_by``).  ``own``: the keyed rows of this relay's
        batch in flight, which the new batch may follow within their keys (it is then
        published only after that batch is committed).

        Binary results (``_claim_cursor``): each payload is a view of the driver's
        result, held once; the result is freed when the batch's rows are dropped.

        Crash right after: the open transaction dies with the session, the rows are
        free again at once; nothing to clean up.
        """
        params = {
            "limit": limit,
            "window": limit * KEYED_WINDOW,
            "max_bytes": max_bytes,
            "hold": hold_keys,
            "own": list(own),
        }
        with self._translated("claiming a batch"):
            self.conn.execute(f"BEGIN; {PINNED_CLAIM_PLAN}")
            with _claim_cursor(self.conn) as cur:
                cur.execute(self.queries["claim_batch"], params)
                records = cur.fetchall()
            rows = [_row(r) for r in _with_texts(self.conn, records)]
            return sorted(rows, key=lambda row: row.id)

    def abandon_claim(self) -> None:
        """Roll back an unprepared claim (nothing claimed, or before PREPARE)."""
        with self._translated("rolling back a claim"):
            self.conn.execute("ROLLBACK")

    def prepare(self, gid: str) -> None:
        """PREPARE TRANSACTION: the claim survives any crash, undecided.

        Raises ``OutcomeUnknown`` if the connection drops, because PREPARE may or
        may not have happened; the caller must not publish and must look the gid
        up (``gid_exists``) after reconnecting.
        """
        stmt = sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid))
        try:
            self.conn.execute(stmt)
        except pgerrors.ObjectNotInPrerequisiteState as exc:
            self._rollback_quietly()
            raise PreparedTransactionsDisabled(
                "PostgreSQL refused PREPARE TRANSACTION: prepared transactions are disabled",
                "set max_prepared_transactions > 0 and restart PostgreSQL",
            ) from exc
        except psycopg.Error as exc:
            if _lost(self.conn, exc) or isinstance(exc, pgerrors.QueryCanceled):
                self._rollback_quietly()  # a failed PREPARE has ended the transaction
                raise OutcomeUnknown(f"PREPARE of {gid} was cut off: {_first_line(exc)}") from exc
            self._rollback_quietly()
            if "maximum number of prepared transactions" in str(exc):
                raise PreparedSlotsExhausted(
                    "every prepared-transaction slot of the server is in use",
                    "raise max_prepared_transactions or run fewer relays; "
                    "the relay backs off and retries",
                ) from exc
            raise DatabaseUnavailable(f"PREPARE TRANSACTION failed: {_first_line(exc)}") from exc

    def _rollback_quietly(self) -> None:
        with contextlib.suppress(psycopg.Error):
            self.conn.execute("ROLLBACK")

    def finish(self, gid: str, *, commit: bool) -> bool:
        """COMMIT PREPARED or ROLLBACK PREPARED; False if the gid was finished elsewhere.

        Two finishers may race on one gid: the loser sees 42704 (no such gid) or
        55000 (busy), and both mean someone else is finishing it.  A dropped
        connection raises ``OutcomeUnknown``.
        """
        verb = "COMMIT PREPARED" if commit else "ROLLBACK PREPARED"
        stmt = sql.SQL(verb + " {}").format(sql.Literal(gid))
        try:
            self.conn.execute(stmt)
        except (pgerrors.UndefinedObject, pgerrors.ObjectNotInPrerequisiteState):
            return False
        except psycopg.Error as exc:
            # A statement timeout (or an operator's pg_cancel_backend) may strike
            # before or after the server finished: look the gid up, like a cut.
            if _lost(self.conn, exc) or isinstance(exc, pgerrors.QueryCanceled):
                raise OutcomeUnknown(f"{verb} of {gid} was cut off: {_first_line(exc)}") from exc
            raise
        return True

    def gid_exists(self, gid: str) -> bool:
        with self._translated("looking up a prepared batch"):
            row = self.conn.execute(self.queries["prepared_gid_exists"], {"gid": gid}).fetchone()
            return bool(row and row["present"])

    def record_dead_letters(self, dead: Sequence[DeadLetter], gid: str) -> None:
        """Store rows that can never be published, in a transaction of their own.

        This commits before the batch's COMMIT PREPARED.  A crash in between rolls
        the batch back: the row is then both a dead letter and in the outbox, is
        tried again and dead-lettered again (``attempts`` counts up).  At no moment
        is it in neither place.
        """
        params = [_dead_letter_params(d, gid) for d in dead]
        try:
            with self._translated("recording dead letters"), self.conn.transaction():
                self.conn.cursor().executemany(self.queries["record_dead_letters"], params)
        except MissingPrivileges as exc:
            exact = self._missing(privileges.DEAD_LETTERS_WRITE, "recording dead letters") or exc
            raise DeadLettersUnwritable(exact.message, exact.hint) from exc
        except psycopg.Error as exc:  # a constraint or trigger someone added, ...
            raise DeadLettersUnwritable(
                f"PostgreSQL refused to record dead letters: {_first_line(exc)}",
                "the batch was rolled back; the relay retries with backoff",
            ) from exc

    def has_claimable_rows(self) -> bool:
        with self._translated("looking for claimable rows"), self.conn.transaction():
            row = self.conn.execute(self.queries["has_claimable_rows"]).fetchone()
            return bool(row and row["claimable"])

    def replication(self) -> Replication:
        with self._translated("reading pg_stat_replication"):
            row = self.conn.execute(self.queries["replication"]).fetchone()
        assert row is not None
        return Replication(row["standbys"], row["synchronous"], row["hidden"])

    # -- what resolvers and status read ---------------------------------------
    def prepared_batches(self) -> list[PreparedBatch]:
        with self._translated("reading pg_prepared_xacts"):
            rows = self.conn.execute(self.queries["prepared_batches"]).fetchall()
        return [PreparedBatch(**r) for r in rows]

    def relay_liveness(self, relay_ids: Sequence[str]) -> dict[str, RelayLiveness]:
        if not relay_ids:
            return {}
        with self._translated("checking relay liveness"):
            rows = self.conn.execute(
                self.queries["relay_liveness"],
                {
                    "relay_ids": list(relay_ids),
                    "lock_keys": [gids.lock_key(r) for r in relay_ids],
                    "lock_class": gids.LOCK_CLASS,
                },
            ).fetchall()
        return {
            r["relay_id"]: RelayLiveness(
                relay_id=r["relay_id"],
                lock_held=r["backend_pid"] is not None,
                heartbeat_age=r["heartbeat_age"],
                backend_pid=r["backend_pid"],
            )
            for r in rows
        }

    def terminate_backend(self, pid: int) -> bool:
        """End a partitioned relay's control session, so its death becomes certain."""
        with self._translated("terminating a relay session"):
            row = self.conn.execute("SELECT pg_terminate_backend(%s) AS done", [pid]).fetchone()
            return bool(row and row["done"])

    def forget_dead_relays(self, older_than: float) -> int:
        with self._translated("pruning the relay registry"):
            cur = self.conn.execute(
                self.queries["forget_dead_relays"],
                {
                    "older_than": older_than,
                    "lock_class": gids.LOCK_CLASS,
                    "gid_prefix": gids.relay_prefix(self.table),
                },
            )
            return cur.rowcount

    def live_relays(self) -> list[Row]:
        with self._translated("listing relays"):
            return self.conn.execute(
                self.queries["live_relays"], {"lock_class": gids.LOCK_CLASS}
            ).fetchall()

    def backlog(self) -> Row:
        with self._translated("measuring the backlog"):
            row = self.conn.execute(self.queries["backlog"]).fetchone()
            assert row is not None
            return row

    def dead_letter_summary(self) -> tuple[int, int]:
        """Dead letters, and how many ordering keys they belong to."""
        with self._translated("counting dead letters"):
            row = self.conn.execute(self.queries["dead_letter_count"]).fetchone()
            return (int(row["dead_letters"]), int(row["ordering_keys"])) if row else (0, 0)

    def metrics_snapshot(self) -> Row:
        """Backlog, prepared batches, dead letters and live relays in one round trip."""
        with self._translated("reading metrics"):
            row = self.conn.execute(
                self.queries["metrics_snapshot"],
                {"gid_prefix": gids.relay_prefix(self.table), "lock_class": gids.LOCK_CLASS},
            ).fetchone()
            assert row is not None
            return row


class DeadLetterStore(_Session):
    """What ``outbox dead-letters`` reads and changes; each call is one transaction."""

    def __init__(self, dsn: str, table: str, *, connect_timeout: float = 10.0) -> None:
        super().__init__(dsn, table, "outbox-dead-letters", connect_timeout)

    def entries(self, limit: int) -> list[Row]:
        self.check_privileges(privileges.DEAD_LETTERS_LIST, "outbox dead-letters list")
        with self._translated("listing dead letters"):
            return self.conn.execute(self.queries["list_dead_letters"], {"limit": limit}).fetchall()

    def retry(
        self,
        *,
        everything: bool,
        message_ids: Sequence[uuid.UUID] = (),
        row_ids: Sequence[int] = (),
        ordering_keys: Sequence[str] = (),
    ) -> list[Row]:
        """Move dead letters back into the outbox atomically; the (id, message_id,
        ordering_key) moved."""
        self.check_privileges(privileges.DEAD_LETTERS_RETRY, "outbox dead-letters retry")
        with self._translated("retrying dead letters"):
            return self.conn.execute(
                self.queries["retry_dead_letters"],
                {
                    "all": everything,
                    "ids": list(message_ids),
                    "row_ids": list(row_ids),
                    "keys": list(ordering_keys),
                },
            ).fetchall()

    def purge(
        self,
        *,
        everything: bool,
        message_ids: Sequence[uuid.UUID] = (),
        row_ids: Sequence[int] = (),
        ordering_keys: Sequence[str] = (),
        older_than: float | None = None,
    ) -> list[Row]:
        """Delete dead letters failed more than ``older_than`` s ago; the (id, message_id)."""
        self.check_privileges(privileges.DEAD_LETTERS_PURGE, "outbox dead-letters purge")
        with self._translated("purging dead letters"):
            return self.conn.execute(
                self.queries["purge_dead_letters"],
                {
                    "all": everything,
                    "ids": list(message_ids),
                    "row_ids": list(row_ids),
                    "keys": list(ordering_keys),
                    "older_than": older_than,
                },
            ).fetchall()


class ControlSession(_Session):
    """The relay's proof of life: its advisory lock and its heartbeat.

    Used by one thread only (``outbox.relay.liveness.Liveness``), so that no statement of
    the batch loop, however slow, can delay a heartbeat.
    """

    def __init__(
        self,
        dsn: str,
        table: str,
        relay_id: str,
        *,
        connect_timeout: float = 10.0,
        statement_timeout: float | None = None,
    ) -> None:
        super().__init__(
            dsn,
            table,
            f"outbox-relay-control:{relay_id[:12]}",
            connect_timeout,
            statement_timeout,
        )
        self.relay_id = relay_id

    def acquire(self) -> bool:
        """Take the relay's advisory lock and register; False if the key is taken."""
        with self._translated("registering the relay"):
            row = self.conn.execute(
                self.queries["try_lock_relay"],
                {"lock_class": gids.LOCK_CLASS, "lock_key": gids.lock_key(self.relay_id)},
            ).fetchone()
            if not row or not row["locked"]:
                return False
            self.conn.execute(
                self.queries["register_relay"],
                {
                    "relay_id": self.relay_id,
                    "lock_key": gids.lock_key(self.relay_id),
                    "hostname": socket.gethostname(),
                    "pid": os.getpid(),
                },
            )
            return True

    def heartbeat(self) -> None:
        with self._translated("writing the heartbeat"):
            self.conn.execute(self.queries["heartbeat"], {"relay_id": self.relay_id})

    def unregister(self) -> None:
        with self._translated("unregistering the relay"):
            self.conn.execute(self.queries["unregister_relay"], {"relay_id": self.relay_id})


class WakeupListener(_Session):
    """LISTENs for the outbox trigger's NOTIFY; the idle relay waits on its socket.

    A session of its own: a transaction that ran LISTEN cannot be prepared, and the
    control session belongs to the heartbeat thread.
    """

    def __init__(self, dsn: str, table: str, *, connect_timeout: float = 10.0) -> None:
        super().__init__(dsn, table, "outbox-relay-wakeup", connect_timeout)
        with self._translated("subscribing to wake-ups"):
            self.conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.table)))

    def fileno(self) -> int:
        return self.conn.fileno()

    def take_notifications(self) -> int:
        """How many wake-ups arrived since the last call (never blocks)."""
        with self._translated("reading wake-ups"):
            return sum(1 for _ in self.conn.notifies(timeout=0))

    def rows_waiting(self) -> bool:
        """The fallback poll: True if the outbox table has any row."""
        with self._translated("polling for rows"):
            row = self.conn.execute(self.queries["rows_waiting"]).fetchone()
            return row is None or bool(row["rows_waiting"])
