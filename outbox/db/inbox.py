"""The consumer's inbox in its own PostgreSQL database: statements only.

``InboxStore`` owns one connection and runs the inbox's statements on it; the
order of the steps of a message (record its id, call the handler, check what the
handler left, commit or fail) is the steps' (``outbox.inbox.steps``), which talk
to this class through ``steps.StorePort``.  The connection is the one handed to
handlers (tuple rows, autocommit, as psycopg gives them).

The session is read-only by default (``default_transaction_read_only``); only the
consumer's own transactions are ``BEGIN READ WRITE``.  So the effects of a message
can only be written inside the transaction that records its id: a handler that
ends that transaction (COMMIT, ROLLBACK) and writes on can write nothing, and a
COMMIT it runs in that transaction fails by itself (the inbox's ``guard``
trigger, see ``inbox.sql``).  No id is committed without its effect, and no
effect without its id.

Statements:

- ``record_ids`` starts the transaction (BEGIN READ WRITE, pipelined with it)
  and records the batch's ids in one statement; it returns when the transaction
  started with the ids that are new (the others are duplicates);
- ``seal`` just before ``commit`` returns the start again (a handler that ended
  the transaction and went on in a new one shows as another start);
- ``record_failure`` counts a failed attempt and parks the message at
  ``max_attempts``, recording its id in the same transaction so that no later copy
  of it is applied; ``park`` parks a message that cannot be handled at all.

The inbox records ids as text; ids a text column cannot hold are escaped
losslessly (``outbox.amqp.message.inbox_key``).  The tables are created and
upgraded at start-up (``ensure_schema``): a look in the catalog, and only if a
piece is missing (``SCHEMA``), its DDL under a short ``lock_timeout`` and an
advisory lock, retried; the consumer's database is not the outbox's, so this is
not an outbox migration.
Connections and the telling of a lost session from a refused statement are
``outbox.db.session``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import operator
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import psycopg
from psycopg import Column, sql
from psycopg import errors as pgerrors
from psycopg.pq import PipelineStatus, TransactionStatus
from psycopg.rows import Row, dict_row, tuple_row
from psycopg.types.json import Jsonb

from outbox.db.migrate import SAY_HOLDERS, Holder, describe_holder, retry_pause
from outbox.db.queries import LISTED, load_blocks, search_terms
from outbox.db.session import (
    LOCK_HOLDERS,
    OPERATOR_BOUNDS,
    Hints,
    OperatorBounds,
    connect,
    first_line,
    hint_for,
    translated,
)
from outbox.errors import DatabaseUnavailable, OutboxError, SchemaNotReady, StatementTimedOut

DEFAULT_INBOX_TABLE = "outbox_inbox"


# What the store writes of a message the consumer parks (``outbox.inbox.steps.
# parking_for``) or takes into custody (``outbox.inbox.custody.stored``).
@dataclasses.dataclass(frozen=True)
class Parking:
    """Everything kept about a parked message, enough to publish it again.

    ``message_id``, ``exchange`` and ``routing_key`` are inbox keys (``inbox_key``:
    lossless); ``headers``, ``properties`` and ``error`` are for people to read;
    ``raw_properties`` is what ``outbox parked retry`` sends back.
    """

    message_id: str | None
    queue: str
    exchange: str
    routing_key: str
    body: bytes
    headers: dict[str, Any]
    properties: dict[str, Any]
    error: str
    raw_properties: bytes | None = None


@dataclasses.dataclass(frozen=True)
class Stored:
    """A message as ``<inbox>_custody`` keeps it: text columns as inbox keys
    (lossless, ``inbox_key``), the property list as it arrived."""

    message_id: str
    ordering_key: str | None
    exchange: str
    routing_key: str
    body: bytes
    raw_properties: bytes


# The consumer's lock_timeout (seconds): its handlers' for any lock (a handler's
# statement that waits longer fails like any other error), and its own statements'.
INBOX_LOCK_TIMEOUT = 5.0
# The lock_timeout of the steps that record a message's id or count its attempt
# (seconds): how long a message waits for its inbox row or attempt lock held by
# another transaction before it gives up (``InboxRowHeld``) and is set aside, so
# that the messages behind it go on.  Long enough for another consumer's batch
# applying a copy to commit; short, because it is paid on the consumer's only
# thread each time the held message is tried again.
RECORD_LOCK_TIMEOUT = 0.2

# Advisory-lock class of ``ensure_schema``; distinct from migrate's and the relays'.
SCHEMA_LOCK_CLASS = 0x6F6269
# How a holder of that lock is named (``_schema_holders``).
SCHEMA_LOCK_NAME = "the inbox schema lock"
# How long one attempt at a missing piece of the schema waits for its locks, with
# the other consumers' INSERTs queued behind it, before it lets them go, pauses
# (``retry_pause``) and tries again (seconds).
SCHEMA_LOCK_TIMEOUT = 1.0
# Advisory-lock class of a redelivered message's attempt (``start_attempt``).
ATTEMPT_LOCK_CLASS = 0x6F6261

# The connection settings a handler could change; restored after each failure.
SETTINGS = (
    "autocommit",
    "isolation_level",
    "read_only",
    "deferrable",
    "row_factory",
    "cursor_factory",
    "server_cursor_factory",
    "prepare_threshold",
    "prepared_max",
)
# All of them at once, in C (``session`` runs before and after every handler call).
_read_settings = operator.attrgetter(*SETTINGS)


def inbox_identifiers(table: str) -> dict[str, sql.Composable]:
    return {
        "inbox": sql.Identifier(table),
        "inbox_by_age": sql.Identifier(f"{table}_by_age"),
        "attempts": sql.Identifier(f"{table}_attempts"),
        "parked": sql.Identifier(f"{table}_parked"),
        "custody": sql.Identifier(f"{table}_custody"),
        "guard": sql.Identifier(f"{table}_guard"),
        # Names as values, for the schema's catalog look-ups.
        "inbox_name": sql.Literal(table),
        "inbox_by_age_name": sql.Literal(f"{table}_by_age"),
        "attempts_name": sql.Literal(f"{table}_attempts"),
        "parked_name": sql.Literal(f"{table}_parked"),
        "custody_name": sql.Literal(f"{table}_custody"),
        "guard_name": sql.Literal(f"{table}_guard"),
        "guard_signature": sql.Literal(f"{table}_guard()"),
    }


class SchemaStep(NamedTuple):
    """One piece of the inbox's schema: ``create``, the block of ``inbox.sql`` that
    makes it (idempotent), and ``present``, a catalog read that says whether it is
    there (it takes no lock on the inbox's tables)."""

    create: str
    present: str


# The inbox's schema, in the order it is made (``ensure_schema``, ``render_sql``).
# One more table, column or index later: its block in inbox.sql and one line here.
SCHEMA = (
    SchemaStep("create_inbox", "to_regclass({inbox_name}) IS NOT NULL"),
    SchemaStep(
        "create_inbox_by_age",
        "EXISTS (SELECT FROM pg_index WHERE indexrelid = to_regclass({inbox_by_age_name})"
        " AND indrelid = to_regclass({inbox_name}))",
    ),
    SchemaStep("create_attempts", "to_regclass({attempts_name}) IS NOT NULL"),
    SchemaStep("create_parked", "to_regclass({parked_name}) IS NOT NULL"),
    SchemaStep(
        "add_parked_raw_properties",
        "EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass({parked_name})"
        " AND attname = 'raw_properties' AND NOT attisdropped)",
    ),
    SchemaStep("create_custody", "to_regclass({custody_name}) IS NOT NULL"),
    SchemaStep("create_guard", "to_regprocedure({guard_signature}) IS NOT NULL"),
    SchemaStep(
        "create_guard_trigger",
        "EXISTS (SELECT FROM pg_trigger WHERE tgrelid = to_regclass({inbox_name})"
        " AND tgname = {guard_name})",
    ),
)


def _statements(table: str) -> dict[str, sql.Composed]:
    ids = inbox_identifiers(table)
    return {
        name: sql.SQL(body).format(**ids)
        for name, body in load_blocks("outbox.db", "inbox.sql").items()
    }


def schema_checks(table: str, steps: Sequence[SchemaStep] = SCHEMA) -> sql.Composed:
    """One catalog read: a boolean per step of ``steps``, whether its piece is there."""
    ids = inbox_identifiers(table)
    return sql.SQL("SELECT {}").format(
        sql.SQL(", ").join(sql.SQL(step.present).format(**ids) for step in steps)
    )


def render_sql(table: str) -> str:
    """The inbox tables as one script (``outbox consume --print-sql``)."""
    queries = _statements(table)
    schema = "\n".join(queries[step.create].as_string(None) + ";" for step in SCHEMA)
    return f"-- outbox consume: inbox tables {table!r}\nBEGIN;\n{schema}\nCOMMIT;\n"


# psycopg reads a cursor's result on demand for fetch*() in pipeline mode, but not
# for rowcount, statusmessage, description or rownumber: ``PipelinedCursor`` does,
# so a handler that reads them sees what it would see without pipelining.  It calls
# the private ``Cursor._fetch_pipeline`` (what fetch*() calls): psycopg has no public
# "wait for this cursor's result"; the public ways (``Pipeline.sync``, a fetch*())
# end the pipeline's batch or take a row.  Without it the consumer does not
# pipeline (``pipelining``): slower, still right.  .ci/matrix runs
# tests/integration/inbox/test_pipeline.py on the oldest and newest psycopg allowed.
_FETCH_ON_DEMAND = hasattr(psycopg.Cursor, "_fetch_pipeline")


class PipelinedCursor(psycopg.Cursor[Row]):
    """The cursor handed to handlers: in pipeline mode, reading a result's
    properties first waits for that result (a round trip, as without pipelining)."""

    def _result(self) -> None:
        if self.connection.pgconn.pipeline_status != PipelineStatus.OFF:
            self._fetch_pipeline()

    @property
    def rowcount(self) -> int:
        self._result()
        return super().rowcount

    @property
    def statusmessage(self) -> str | None:
        self._result()
        return super().statusmessage

    @property
    def description(self) -> list[Column] | None:
        self._result()
        return super().description

    @property
    def rownumber(self) -> int | None:
        self._result()
        return super().rownumber


class InboxRowHeld(OutboxError):
    """A message's inbox row or attempt lock stayed held longer than
    ``RECORD_LOCK_TIMEOUT`` (by a transaction that inserted or removes the id and
    waits on something else: ``outbox parked retry`` of releases before 0.5.0 held
    it across its publish; an application's session; or another consumer applying
    a copy).  Nothing was written: the consumer keeps the message in hand, unacked,
    and tries it again later, without an attempt counted; the others go on."""


class StatementRefused(OutboxError):
    """PostgreSQL refused a statement on a live session (a deadlock between two
    consumers' batches, a deferred constraint at COMMIT, a serialization failure).
    The transaction is over; the session is fine."""


def _refused(what: str, exc: Exception) -> StatementRefused:
    return StatementRefused(
        f"PostgreSQL refused {what}: {first_line(exc)}",
        "check the inbox tables (outbox consume --print-sql) and the role's rights",
    )


@dataclasses.dataclass(frozen=True)
class Failure:
    """What ``record_failure`` did: ``parked`` or not, after ``attempts`` attempts;
    ``duplicate`` if another copy of the message was applied meanwhile."""

    attempts: int
    parked: bool
    duplicate: bool = False


@dataclasses.dataclass(frozen=True)
class Started:
    """What ``start_attempt`` found: the id already in the inbox (``duplicate``:
    nothing written, the lock released), else the count of the message's
    ``earlier`` attempts (this one was counted if they are below the limit) and
    the last error one of them raised ('' if none did)."""

    duplicate: bool
    earlier: int
    last_error: str


@dataclasses.dataclass(frozen=True)
class InCustody:
    """What ``next_in_custody`` found: the rows to apply now (``id``, ``message_id``,
    ``queue``, ``exchange``, ``routing_key``, ``body``, ``raw_properties``), how many
    messages custody holds in all, and in how many seconds the next one that is not
    due yet will be (None: none waits)."""

    due: list[tuple[Any, ...]]
    held: int
    next_in: float | None


@dataclasses.dataclass(frozen=True)
class SchemaWait:
    """An attempt at the ``missing`` pieces of the schema gave its place in the lock
    queue up after ``SCHEMA_LOCK_TIMEOUT`` (``ensure_schema``)."""

    missing: tuple[str, ...]  # blocks of inbox.sql
    attempt: int
    waited: float  # seconds since the first attempt
    holders: tuple[Holder, ...]

    def describe(self) -> str:
        """What it waits for, in one line."""
        parts = [_holder(h) for h in self.holders[:SAY_HOLDERS]]
        if len(self.holders) > SAY_HOLDERS:
            parts.append(f"{len(self.holders) - SAY_HOLDERS} more")
        return "; ".join(parts) or "locks held for a moment by other transactions on the tables"


def _holder(holder: Holder) -> str:
    if holder.relation == SCHEMA_LOCK_NAME:
        name = holder.application_name or "no application_name"
        return f"another consumer making the inbox tables (pid {holder.pid}, {name})"
    if holder.gid is not None:
        return (
            f"prepared transaction {holder.gid!r} ({holder.seconds:.0f} s old) on "
            f"{holder.relation}: its owner must finish it (COMMIT PREPARED or ROLLBACK PREPARED)"
        )
    return describe_holder(holder, "")


class SessionState(NamedTuple):
    """What a handler can see and change of the session it is handed (read
    without I/O): the loop compares it before and after each handler call (a
    tuple: built for every message, it must be cheap)."""

    closed: bool
    broken: bool
    transaction: str  # idle, active, intrans, inerror, unknown
    settings: tuple[Any, ...]  # the values of ``SETTINGS``, in that order


def describe(exc: BaseException) -> str:
    """One line for logs and the parked table: type, message, and where it was
    raised.  Never raises, whatever the exception's ``str`` does."""
    where = ""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None:
        where = f" ({tb.tb_frame.f_code.co_filename}:{tb.tb_lineno})"
    try:
        text = first_line(exc)
    except BaseException:  # a handler's __str__ may raise anything, SystemExit too
        text = "(its message cannot be shown)"
    if len(text) > DESCRIBED_MOST:
        text = f"{text[:DESCRIBED_MOST]}... ({len(text):,} characters)"
    return f"{type(exc).__name__}: {text}{where}"


def _set_local_lock_timeout(seconds: float) -> str:
    # SET LOCAL: back to the session's value at the transaction's end, whatever happens.
    return f"SET LOCAL lock_timeout = {max(1, round(seconds * 1000))}"


# The most of an exception's first line kept in logs and in the attempts and parked
# tables: a handler's exception may carry megabytes (a whole response body), which
# every retry would log and store again.
DESCRIBED_MOST = 2000


@contextlib.contextmanager
def _held() -> Iterator[None]:
    """``InboxRowHeld`` for a lock wait that outlived the session's lock_timeout."""
    try:
        yield
    except StatementTimedOut as exc:
        if not isinstance(exc.__cause__, pgerrors.LockNotAvailable):
            raise
        raise InboxRowHeld(exc.message, exc.hint) from exc


class InboxStore:
    # Whether sessions get a client deadline (``outbox.db.session.connect``): not the
    # consumer's (its handlers' statements have no statement_timeout).
    client_deadline = False
    hints = Hints.daemon("consumer")  # how its errors' hints say to go on

    def __init__(
        self,
        dsn: str,
        table: str,
        consumer: str,
        *,
        application_name: str = "outbox-consume",
        connect_timeout: float = 10.0,
        lock_timeout: float | None = None,
        statement_timeout: float | None = None,
        record_lock_timeout: float = RECORD_LOCK_TIMEOUT,
    ) -> None:
        """``lock_timeout`` None: ``INBOX_LOCK_TIMEOUT``; ``statement_timeout`` None:
        none (a handler's statements may take as long as they need);
        ``record_lock_timeout``: the steps' that record ids (at most ``lock_timeout``)."""
        self.table = table
        self.consumer = consumer
        self.queries = _statements(table)
        self._dsn = dsn
        self._application_name = application_name
        self._connect_timeout = connect_timeout
        self.lock_timeout = INBOX_LOCK_TIMEOUT if lock_timeout is None else lock_timeout
        # The steps that record ids wait less than the handlers (``_recording``).
        self.record_lock_timeout = min(self.lock_timeout, record_lock_timeout)
        self._record_lock_timeout = _set_local_lock_timeout(self.record_lock_timeout)
        self._session_lock_timeout = _set_local_lock_timeout(self.lock_timeout)
        self.statement_timeout = statement_timeout
        # The session's idle_in_transaction_session_timeout in seconds (None: off).
        # PostgreSQL applies it only between synced statements, so a handler that
        # runs longer in pipeline mode is failed by the loop instead.
        self.idle_timeout: float | None = None
        # The session that holds an attempt lock (``start_attempt``), if any.
        self._attempt_session: psycopg.Connection[Any] | None = None
        self.conn = self._connect()

    def _open(self) -> psycopg.Connection[Any]:
        """A new session (``outbox.inbox.aio`` opens an ``AsyncConnection`` instead)."""
        conn: psycopg.Connection[Any] = connect(
            self._dsn,
            application_name=self._application_name,
            connect_timeout=self._connect_timeout,
            statement_timeout=self.statement_timeout,
            lock_timeout=self.lock_timeout,
            client_deadline=self.client_deadline,
        )
        # outbox.db.session gives dict rows; handlers get psycopg's default tuples.
        conn.row_factory = tuple_row
        conn.cursor_factory = PipelinedCursor
        return conn

    def _connect(self) -> psycopg.Connection[Any]:
        conn = self._open()
        try:
            conn.execute("SET default_transaction_read_only = on")
            row = conn.execute(
                "SELECT setting::float8 / 1000 FROM pg_settings "
                "WHERE name = 'idle_in_transaction_session_timeout'"
            ).fetchone()
            self.idle_timeout = float(row[0]) if row and row[0] else None
        except psycopg.Error as exc:
            conn.close()
            raise DatabaseUnavailable(
                f"cannot configure the consumer's PostgreSQL session: {first_line(exc)}",
                hint_for(exc),
            ) from exc
        return conn

    @property
    def connection(self) -> psycopg.Connection[Any]:
        """The connection handed to handlers."""
        return self.conn

    @property
    def broken(self) -> bool:
        return self.conn.broken or self.conn.closed

    def reconnect(self) -> None:
        """A new session in place of this one (``DatabaseUnavailable`` if none)."""
        self.close()
        self.conn = self._connect()

    def close(self) -> None:
        held, self._attempt_session = self._attempt_session, None
        with contextlib.suppress(Exception):
            self.conn.close()
        if held is not None and held is not self.conn:
            with contextlib.suppress(Exception):
                held.close()

    @contextlib.contextmanager
    def _translated(self, what: str, *, lock_timeout: float | None = None) -> Iterator[None]:
        """Driver errors as the project's; ``lock_timeout``: the statements' own, if
        not the session's (named in a lock wait's error)."""
        with translated(
            self.conn,
            what,
            hints=self.hints,
            statement_timeout=self.statement_timeout,
            lock_timeout=self.lock_timeout if lock_timeout is None else lock_timeout,
            tables=[
                self.table,
                f"{self.table}_attempts",
                f"{self.table}_parked",
                f"{self.table}_custody",
            ],
            refused=_refused,
        ):
            yield

    @contextlib.contextmanager
    def _transaction(self, what: str) -> Iterator[psycopg.Connection[Any]]:
        """One read-write transaction of the store's own (commits at the end)."""
        with self._translated(what):
            self.conn.execute("BEGIN READ WRITE")
            try:
                yield self.conn
            except BaseException:
                if not self.broken:
                    self.conn.execute("ROLLBACK")
                raise
            self.conn.execute("COMMIT")

    @contextlib.contextmanager
    def _reading(self, what: str) -> Iterator[psycopg.Connection[Any]]:
        """Statements that only read (each its own read-only transaction)."""
        with self._translated(what):
            yield self.conn

    def _params(self, **values: Any) -> dict[str, Any]:
        return {"consumer": self.consumer, **values}

    # -- set-up ---------------------------------------------------------------
    def ensure_schema(self, wait: Callable[[SchemaWait], None] | None = None) -> None:
        """Make what is missing of the inbox's schema (``SCHEMA``).

        A look in the catalog first, which takes no lock on the inbox's tables:
        when every piece is there (every start but the first) nothing else runs,
        so a consumer's start or reconnect never waits behind another's open
        transaction, nor makes the others' INSERTs queue behind it.  The missing
        pieces are made in one transaction under the schema's advisory lock
        (concurrent consumers make each once) and ``SCHEMA_LOCK_TIMEOUT``: when
        that runs out the attempt gives its place in the lock queue up, so the
        consumers queued behind it go on, ``wait`` hears what it waited for (and
        pauses; by default ``retry_pause``), and it tries again until done."""
        missing = self._missing(SCHEMA)
        started = time.monotonic()
        attempt = 0
        while missing:
            attempt += 1
            try:
                self._create(missing)
                return
            except StatementTimedOut as exc:
                if not isinstance(exc.__cause__, pgerrors.LockNotAvailable):
                    raise
            blocked = SchemaWait(
                tuple(step.create for step in missing),
                attempt,
                time.monotonic() - started,
                self._schema_holders(),
            )
            if wait is None:
                time.sleep(retry_pause(attempt))
            else:
                wait(blocked)
            missing = self._missing(missing)

    def _missing(self, steps: Sequence[SchemaStep]) -> list[SchemaStep]:
        with self._reading("looking for the inbox tables") as conn:
            row = conn.execute(schema_checks(self.table, steps)).fetchone()
        assert row is not None  # a SELECT without FROM returns one row
        return [step for step, present in zip(steps, row, strict=True) if not present]

    def _create(self, missing: Sequence[SchemaStep]) -> None:
        """One attempt at ``missing``, each looked for again under the lock (another
        consumer may have made it meanwhile)."""
        with self._transaction("creating the inbox tables") as conn:
            conn.execute(
                "SELECT set_config('lock_timeout', %s, true)",
                [str(round(SCHEMA_LOCK_TIMEOUT * 1000))],
            )
            conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", self._schema_lock())
            row = conn.execute(schema_checks(self.table, missing)).fetchone()
            assert row is not None
            for step, present in zip(missing, row, strict=True):
                if not present:
                    conn.execute(self.queries[step.create])

    def _schema_lock(self) -> list[int]:
        return [SCHEMA_LOCK_CLASS, zlib.crc32(self.table.encode()) & 0x7FFFFFFF]

    def _schema_holders(self) -> tuple[Holder, ...]:
        """Who holds a lock a schema attempt waited for (``session.LOCK_HOLDERS``, as
        ``outbox init`` asks): the sessions and prepared transactions of this database
        holding a lock on the inbox's tables, and whoever holds the schema lock;
        transactions younger than ``SCHEMA_LOCK_TIMEOUT`` are other consumers'
        batches, come and gone."""
        lock_class, lock_key = self._schema_lock()
        with self._reading("looking at what holds the inbox tables") as conn:
            rows = conn.execute(
                LOCK_HOLDERS,
                {
                    "tables": [self.table, f"{self.table}_attempts", f"{self.table}_parked"],
                    "lock_class": lock_class,
                    "lock_key": lock_key,
                    "lock_name": SCHEMA_LOCK_NAME,
                },
            ).fetchall()
        return tuple(
            Holder(relation, gid, pid, name or "", state or "", float(seconds or 0))
            for relation, gid, pid, name, state, seconds in rows
            if gid is not None
            or relation == SCHEMA_LOCK_NAME
            or float(seconds or 0) >= SCHEMA_LOCK_TIMEOUT
        )

    # -- one transaction of messages (the loop's steps) -----------------------------
    def record_ids(
        self, keys: Sequence[str], redelivered: Sequence[str]
    ) -> tuple[datetime.datetime, set[str]]:
        """Start the transaction and record ``keys`` (one round trip); returns when
        the transaction started and the keys that are new.  Attempt counters of
        ``redelivered`` keys go (new ones, and ones applied meanwhile elsewhere)."""
        with (
            _held(),
            self._translated("recording message ids", lock_timeout=self.record_lock_timeout),
            self.conn.pipeline(),
        ):
            cursors = [self.conn.execute(q, p) for q, p in self._recording(keys, redelivered)]
        return self._recorded(cursors)()

    def _recording(
        self, keys: Sequence[str], redelivered: Sequence[str], *, ahead: bool = False
    ) -> list[tuple[Any, dict[str, Any] | None]]:
        """The statements of ``record_ids``: the transaction, then the ids (``ahead``:
        all taken for new, ``record_new``) under ``RECORD_LOCK_TIMEOUT``, the
        session's lock_timeout back for the handlers (``_recorded`` reads the ids'
        result from their cursors)."""
        params = self._params(ids=list(keys), redelivered=list(redelivered))
        query = self.queries["record_new" if ahead else "record_messages"]
        return [
            ("BEGIN READ WRITE", None),
            (self._record_lock_timeout, None),
            (query, params),
            (self._session_lock_timeout, None),
        ]

    def _recorded(self, cursors: Sequence[Any]) -> Callable[[], tuple[datetime.datetime, set[str]]]:
        """How to read ``record_messages``' result from the cursors of ``_recording``."""
        cursor = cursors[2]

        def recorded() -> tuple[datetime.datetime, set[str]]:
            with self._translated("recording message ids"):
                row = cursor.fetchone()
            assert row is not None
            return row[0], set(row[2])

        return recorded

    def seal(self) -> datetime.datetime:
        """The last statement before ``commit``: when the transaction started."""
        with self._translated("checking the transaction before the commit"):
            row = self.conn.execute(self.queries["seal"]).fetchone()
        assert row is not None
        started: datetime.datetime = row[0]
        return started

    @property
    def pipelining(self) -> bool:
        """Whether this psycopg can run a batch's handlers in pipeline mode with
        each cursor's result read on demand (``PipelinedCursor``)."""
        return _FETCH_ON_DEMAND and psycopg.Pipeline.is_supported()

    @contextlib.contextmanager
    def pipeline(
        self, record: tuple[Sequence[str], Sequence[str]] | None = None
    ) -> Iterator[Callable[[], tuple[datetime.datetime, set[str]]] | None]:
        """Statements sent in the block do not wait for their results; the block's
        end waits for all of them (one round trip) and raises the first error,
        translated (``StatementRefused``, or ``DatabaseUnavailable`` if the session
        is gone).  ``record`` (keys, redelivered): the block starts with
        ``record_ids``' statements, and gives how to read their result after it."""
        with self._translated("running the handlers' statements"), self.conn.pipeline():
            if record is None:
                yield None
            else:
                statements = self._recording(*record, ahead=True)
                cursors = [self.conn.execute(q, p) for q, p in statements]
                yield self._recorded(cursors)

    def send_seal(self) -> Callable[[], datetime.datetime]:
        """``seal`` sent inside ``pipeline()``; call the result after the block."""
        with self._translated("checking the transaction before the commit"):
            cur = self.conn.execute(self.queries["seal"])

        def started() -> datetime.datetime:
            with self._translated("checking the transaction before the commit"):
                row = cur.fetchone()
            assert row is not None
            value: datetime.datetime = row[0]
            return value

        return started

    def commit(self) -> None:
        """``DatabaseUnavailable`` here: the outcome is unknown (the inbox decides
        when the messages come back); ``StatementRefused``: rolled back."""
        with self._translated("committing"):
            self.conn.execute("COMMIT")

    def commit_unless(self, unless: Callable[[], str | None]) -> str | None:
        """``commit`` if ``unless()`` gives None (the handlers' statements are
        resolved: the pipeline block has ended); else its reason, uncommitted."""
        reason = unless()
        if reason is None:
            self.commit()
        return reason

    def rollback(self) -> None:
        with self._translated("rolling back"):
            if self.conn.info.transaction_status != TransactionStatus.IDLE:
                self.conn.execute("ROLLBACK")

    def session(self) -> SessionState:
        return session_state(self.conn)

    def restore(self, state: SessionState) -> None:
        """A new session with the settings of ``state``, in place of one a handler
        failed on: what earlier handlers left in it for good (a WITH HOLD cursor,
        a prepared statement, a temporary table, a session lock) must not fail
        the message again (``DatabaseUnavailable`` if no new session).

        The session that holds an attempt lock (``start_attempt``) is kept open,
        idle, until ``end_attempt``: the lock must outlive the failed handler's
        session until the attempt's error is recorded, or a consumer holding a copy
        of the message would go on before it, reading a count without that error."""
        if self._attempt_session is self.conn and not self.broken:
            self.conn = self._connect()  # the old one holds the lock until end_attempt
        else:
            self.reconnect()
        for name, value in zip(SETTINGS, state.settings, strict=True):
            if getattr(self.conn, name) != value:
                setattr(self.conn, name, value)

    # -- attempts of redelivered messages ---------------------------------------------
    def _attempt_lock(self, message_id: str) -> dict[str, Any]:
        key = f"{self.table}\x00{self.consumer}\x00{message_id}".encode("utf-8", "surrogatepass")
        return self._params(
            message_id=message_id,
            lock_class=ATTEMPT_LOCK_CLASS,
            lock_key=zlib.crc32(key) & 0x7FFFFFFF,
        )

    def start_attempt(self, message_id: str, *, max_attempts: int) -> Started:
        """Before a redelivered message's handler is called: take its attempt lock
        (a consumer that holds a copy of it waits here for the other's outcome) and
        commit one more attempt, unless the id is in the inbox or the earlier
        attempts reached ``max_attempts``.  One round trip; the commit is
        asynchronous: the count must survive this process, which a handler may
        kill, not a crash of the server.  The lock stays until ``end_attempt`` or
        the end of the session."""
        params = {**self._attempt_lock(message_id), "max_attempts": max_attempts}
        try:
            with (
                _held(),
                self._translated("counting an attempt", lock_timeout=self.record_lock_timeout),
            ):
                with self.conn.pipeline():
                    self.conn.execute("BEGIN READ WRITE")
                    self.conn.execute(self._record_lock_timeout)
                    self.conn.execute(self.queries["attempt_lock"], params)
                    self.conn.execute("SET LOCAL synchronous_commit = off")
                    cur = self.conn.execute(self.queries["start_attempt"], params)
                    self.conn.execute("COMMIT")
                row = cur.fetchone()
        except InboxRowHeld:
            # The attempt lock is the session's: taken if the inbox row was what held.
            with contextlib.suppress(psycopg.Error):
                self.conn.execute(self.queries["attempt_unlock"], params)
            raise
        assert row is not None
        duplicate = bool(row[0])
        self._attempt_session = None if duplicate else self.conn
        return Started(duplicate=duplicate, earlier=int(row[1]), last_error=str(row[2]))

    def uncount_attempt(self, message_id: str) -> None:
        """Take back the attempt ``start_attempt`` counted for a message whose inbox
        row was then found held (``InboxRowHeld``): no handler call, no attempt.
        ``InboxRowHeld`` if its counter row is held too (the count then stays)."""
        with _held(), self._transaction("taking back an attempt") as conn:
            conn.execute(self._record_lock_timeout)
            conn.execute(self.queries["uncount_attempt"], self._params(message_id=message_id))

    def end_attempt(self, message_id: str) -> None:
        """Release the attempt lock ``start_attempt`` took: unlock it, or end the
        session that holds it if ``restore`` replaced that session (nothing if it is
        gone: the lock went with it)."""
        held, self._attempt_session = self._attempt_session, None
        if held is None:
            return
        if held is not self.conn:
            with contextlib.suppress(Exception):
                held.close()  # the end of the session releases its locks
            return
        if self.broken:
            return
        with self._translated("releasing an attempt lock"):
            self.conn.execute(self.queries["attempt_unlock"], self._attempt_lock(message_id))

    # -- failures and parking (transactions of their own) ---------------------------
    def record_failure(
        self,
        message_id: str,
        error: str,
        *,
        max_attempts: int,
        parking: Parking,
        counted: bool = False,
    ) -> Failure:
        """Count a failed attempt (``counted``: ``start_attempt`` counted it already,
        only its error is recorded); at ``max_attempts`` park the message (its id
        goes into the inbox in the same transaction, so no later copy applies it)."""
        params = self._params(message_id=message_id)
        with self._transaction("recording a failed attempt") as conn:
            row = conn.execute(
                self.queries["count_attempt"],
                {**params, "error": error, "increment": 0 if counted else 1},
            ).fetchone()
            attempts = int(row[0]) if row else 1
            if attempts < max_attempts:
                return Failure(attempts, parked=False)
            if conn.execute(self.queries["record_message"], params).rowcount == 0:
                # Another copy was applied since: nothing to park, the effect exists.
                conn.execute(self.queries["forget_attempts"], params)
                return Failure(attempts, parked=False, duplicate=True)
            self._park(parking, attempts)
            conn.execute(self.queries["forget_attempts"], params)
        return Failure(attempts, parked=True)

    def park(self, parking: Parking) -> None:
        """Park a message that cannot be handled at all (no message id)."""
        with self._transaction("parking a message"):
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
                raw_properties=parking.raw_properties,
                error=parking.error,
                attempts=attempts,
            ),
        )

    # -- custody (``outbox.inbox.custody``) -------------------------------------------
    def take_custody(self, queue: str, messages: Sequence[Stored]) -> None:
        """Store ``messages`` in ``<inbox>_custody`` in one transaction (those whose
        id is in the inbox already are not: copies of applied messages)."""
        params = self._params(
            queue=queue,
            ids=[m.message_id for m in messages],
            keys=[m.ordering_key for m in messages],
            exchanges=[m.exchange for m in messages],
            routing_keys=[m.routing_key for m in messages],
            bodies=[m.body for m in messages],
            raws=[m.raw_properties for m in messages],
        )
        with self._transaction("taking messages into custody") as conn:
            conn.execute(self.queries["take_custody"], params)

    def next_in_custody(self, limit: int) -> InCustody:
        """At most ``limit`` messages in custody to apply now, in order (one read)."""
        with self._reading("reading the messages in custody") as conn:
            rows = conn.execute(
                self.queries["next_in_custody"], self._params(limit=limit)
            ).fetchall()
        due = [tuple(row[:7]) for row in rows if row[0] is not None]
        held = int(rows[0][7]) if rows else 0
        next_in = float(rows[0][8]) if rows and rows[0][8] is not None else None
        return InCustody(due=due, held=held, next_in=next_in)

    def delay_custody(self, message_id: str, delay: float) -> None:
        with self._transaction("delaying a message in custody") as conn:
            conn.execute(
                self.queries["delay_custody"], self._params(message_id=message_id, delay=delay)
            )

    def release_custody(self, message_id: str) -> None:
        with self._transaction("releasing a message from custody") as conn:
            conn.execute(self.queries["release_custody"], self._params(message_id=message_id))

    # -- retention --------------------------------------------------------------
    def prune(self, retention_seconds: float, *, batch: int = 1000, max_batches: int = 10) -> int:
        """Delete inbox ids older than the retention window, ``batch`` rows per
        transaction, at most ``max_batches`` batches per call; returns how many."""
        params = self._params(retention=retention_seconds, batch=batch)
        deleted = 0
        for _ in range(max_batches):
            with self._transaction("pruning the inbox") as conn:
                count = conn.execute(self.queries["prune_inbox"], params).rowcount
            deleted += count
            if count < batch:
                break
        with self._transaction("pruning the inbox") as conn:
            conn.execute(self.queries["prune_attempts"], params)
        return deleted

    # -- figures ------------------------------------------------------------------
    def parked_count(self) -> int:
        with self._reading("counting parked messages") as conn:
            row = conn.execute(self.queries["parked_count"], self._params()).fetchone()
        return int(row[0]) if row else 0


# By the libpq status as an int (``pgconn.transaction_status``; the enum hashes alike).
_STATUS: dict[int, str] = {
    TransactionStatus.IDLE: "idle",
    TransactionStatus.ACTIVE: "active",
    TransactionStatus.INTRANS: "intrans",
    TransactionStatus.INERROR: "inerror",
}


def session_state(conn: Any) -> SessionState:
    """What a handler can see and change of ``conn`` (a ``Connection`` or an
    ``AsyncConnection``), read without I/O."""
    status = conn.pgconn.transaction_status  # conn.info builds an object per call
    return SessionState(
        conn.closed, conn.broken, _STATUS.get(status, "unknown"), _read_settings(conn)
    )


# What an operator is told when ``outbox parked`` (or the console) lost its session.
PARKED_SESSION_LOST = (
    "nothing is lost: a parked message stays listed until the broker has confirmed its "
    "copy, and what was not committed did not happen; run the command again (it is safe "
    "to: the inbox skips a copy whose message was applied); check the server if this "
    "repeats"
)


class ParkedStore(InboxStore):
    """What ``outbox parked`` reads and changes (any consumer's rows in the table)."""

    client_deadline = True  # an operator's: bounded on the client too
    # The consumer's hints ("the consumer reconnects by itself") would name a process
    # that is not involved.
    hints = Hints.operator(PARKED_SESSION_LOST)

    def __init__(self, dsn: str, table: str, bounds: OperatorBounds = OPERATOR_BOUNDS) -> None:
        super().__init__(
            dsn,
            table,
            "",
            application_name="outbox-parked",
            connect_timeout=bounds.connect_timeout,
            lock_timeout=bounds.lock_timeout,
            statement_timeout=bounds.statement_timeout,
        )
        with self._reading("looking for the inbox tables") as conn:
            row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", [f"{table}_parked"])
            found = row.fetchone()
        if not found or not found[0]:
            self.close()
            raise SchemaNotReady(
                f"the inbox table {table}_parked does not exist in this database",
                "check --dsn and --inbox-table; `outbox consume` creates it at start-up "
                "(or apply `outbox consume --print-sql`)",
            )

    def entries(self, limit: int) -> list[dict[str, Any]]:
        with self._reading("listing parked messages") as conn:
            cur = conn.cursor(row_factory=dict_row)
            return cur.execute(self.queries["list_parked"], {**LISTED, "limit": limit}).fetchall()

    def last_parked(self) -> int:
        """The newest parked row's number: a retry run takes none after it."""
        with self._reading("looking at parked messages") as conn:
            row = conn.execute(self.queries["last_parked"]).fetchone()
        return int(row[0]) if row else 0

    def entry(self, parked_id: int, most: int) -> dict[str, Any] | None:
        """One parked message with the first ``most`` bytes of its body (``body_bytes``
        is its size), headers and properties (JSON text)."""
        with self._reading("reading a parked message") as conn:
            cur = conn.cursor(row_factory=dict_row)
            return cur.execute(
                self.queries["parked_message"], {"id": parked_id, "most": most}
            ).fetchone()

    def search(self, text: str, limit: int, offset: int) -> list[dict[str, Any]]:
        """A page of the parked messages whose number is ``text`` or whose message id,
        consumer, queue, destination or error contain it, each with the ``total``."""
        with self._reading("searching parked messages") as conn:
            cur = conn.cursor(row_factory=dict_row)
            return cur.execute(
                self.queries["search_parked"],
                {**search_terms(text), **LISTED, "limit": limit, "offset": offset},
            ).fetchall()

    def groups(self, text: str, limit: int) -> list[dict[str, Any]]:
        """The same parked messages by consumer and error: consumer, error, count,
        oldest, first_id (a row of the group)."""
        with self._reading("grouping parked messages") as conn:
            cur = conn.cursor(row_factory=dict_row)
            return cur.execute(
                self.queries["parked_groups"], {**search_terms(text), **LISTED, "limit": limit}
            ).fetchall()

    def message_ids(self, parked_ids: Sequence[int], group_of: int | None, limit: int) -> list[str]:
        """The message ids of these parked rows, and of the oldest ``limit`` rows of
        row ``group_of``'s group (its consumer and error)."""
        with self._reading("selecting parked messages") as conn:
            rows = conn.execute(
                self.queries["parked_message_ids"],
                {"ids": list(parked_ids), "group_of": group_of, "limit": limit},
            ).fetchall()
        return sorted(str(r[0]) for r in rows)

    def value(self, parked_id: int, what: str, most: int) -> dict[str, Any] | None:
        """The ``size`` of one parked message's ``body``, ``headers`` or ``properties``
        (as bytes), and the ``value`` itself if it has at most ``most`` bytes."""
        with self._reading("reading a parked message") as conn:
            cur = conn.cursor(row_factory=dict_row)
            return cur.execute(
                self.queries["parked_value"], {"id": parked_id, "what": what, "most": most}
            ).fetchone()

    def chart_sample(self) -> dict[str, Any]:
        """parked_now, and the counters ``applied`` (ids ever recorded in the inbox) and
        ``parked`` (rows ever parked or parked again)."""
        with self._reading("sampling the inbox") as conn:
            cur = conn.cursor(row_factory=dict_row)
            row = cur.execute(
                self.queries["chart_sample"],
                {"inbox": self.table, "parked": f"{self.table}_parked"},
            ).fetchone()
        assert row is not None  # a SELECT without FROM returns one row
        return row

    def matching(self, ids: Sequence[str]) -> list[dict[str, Any]]:
        """The parked messages ``outbox.inbox.parked.retry(ids)`` or ``purge(ids)`` would
        take now."""
        with self._reading("selecting parked messages") as conn:
            cur = conn.cursor(row_factory=dict_row)
            return cur.execute(self.queries["select_parked"], {"ids": list(ids)}).fetchall()

    def retry_sizes(
        self, ids: Sequence[str] | None, *, after: int, last: int, limit: int
    ) -> list[tuple[int, int]]:
        """The next parked rows to retry (``ids`` None: any) numbered after ``after``
        up to ``last``: (row number, bytes of every column ``release`` loads: body,
        headers, properties, raw property list, keys), at most ``limit``, in order."""
        with self._reading("selecting parked messages to retry") as conn:
            rows = conn.execute(
                self.queries["retry_sizes"],
                {
                    "all": ids is None,
                    "ids": list(ids or []),
                    "after": after,
                    "last": last,
                    "limit": limit,
                },
            ).fetchall()
        return [(int(r[0]), int(r[1])) for r in rows]

    def release(self, parked_ids: Sequence[int]) -> list[dict[str, Any]]:
        """Retry, step 1: the parked rows with their bodies, their inbox ids and
        attempt counters removed (committed at once, so a copy sent next is
        applied); the rows themselves stay parked until ``retried``."""
        with self._transaction("releasing parked messages for a retry") as conn:
            # Binary: a body arrives as it is stored (text would be hex, twice its size).
            cur = conn.cursor(row_factory=dict_row, binary=True)
            return cur.execute(self.queries["release_parked"], {"ids": list(parked_ids)}).fetchall()

    def retried(self, rows: Sequence[dict[str, Any]]) -> int:
        """Retry, step 3: delete the parked ``rows`` whose copies the broker
        confirmed, except those parked again since ``release``; how many went."""
        if not rows:
            return 0
        with self._transaction("removing retried parked messages") as conn:
            cur = conn.execute(
                self.queries["retried_parked"],
                {"ids": [r["id"] for r in rows], "parked_at": [r["parked_at"] for r in rows]},
            )
            return cur.rowcount

    def purge(self, ids: Sequence[str] | None, older_than: float | None) -> int:
        with self._transaction("purging parked messages") as conn:
            cur = conn.execute(
                self.queries["purge_parked"],
                {"all": ids is None, "ids": list(ids or []), "older_than": older_than},
            )
            return cur.rowcount
