"""Versioned, idempotent schema migrations (``outbox init``), applied online.

Migrations are the files ``schema/NNNN_*.sql``, applied in order under a session
advisory lock, so several ``outbox init`` (or several deploy hooks) running at once
apply each file exactly once.  A file is one transaction, optionally followed by a
line ``-- outside a transaction --`` and statements that PostgreSQL runs only
outside one (``CREATE INDEX CONCURRENTLY``), each on its own; the version row is
written after the last of them.

Online means that the application's INSERTs never queue behind the migration for
long (docs/how-to/upgrading.md).  DDL waits in PostgreSQL's lock queue, and every later
INSERT on that table waits behind it; a prepared batch of a relay that died keeps
its locks until a resolver finishes it.  So on a connection in autocommit mode:

- every attempt runs under ``lock_timeout`` (``LOCK_TIMEOUT``): it gives its place
  in the queue up after that, reports what holds the lock (``Blocked``, with the
  gid of a prepared transaction) to ``on_blocked``, pauses and tries again;
- while an attempt waits, relay claims queued behind it are cancelled
  (``_YieldToRelays``): a pipelined relay finishes its batch in flight only after
  its next claim returns, so that claim, queued behind us, and our DDL, queued
  behind that batch, would otherwise wait for each other until a timeout; a
  cancelled claim costs the relay one retry, never a row or a duplicate;
- indexes are built ``CONCURRENTLY`` (an invalid one left by a killed build is
  dropped and built again);
- ``client_connection_check_interval`` and TCP keepalives make the server drop a
  killed ``outbox init``'s place in the queue within seconds.

Inside a transaction (a Django migration marked ``atomic``) none of that is
possible: the same statements run in that transaction, without ``CONCURRENTLY``.

Rules for writing a migration, so that it stays online: every statement
idempotent (``IF NOT EXISTS``), statements on the outbox table last in the
transaction (the application waits only while that lock is held), nothing slow
while it is held (no table rewrite, no full scan: add columns without volatile
defaults, add ``CHECK``/``FOREIGN KEY`` constraints ``NOT VALID`` and validate them
outside the transaction), every index ``CONCURRENTLY`` outside the transaction.
"""

from __future__ import annotations

import dataclasses
import random
import re
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from importlib import resources
from typing import Any

import psycopg
from psycopg import errors as pgerrors
from psycopg import sql
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row

from outbox import gid as gids
from outbox.db import privileges, session
from outbox.errors import DatabaseUnavailable, MissingPrivileges, SchemaNotReady, SchemaTooNew
from outbox.tables import table_identifiers

# Advisory-lock class of migrations; distinct from gid.LOCK_CLASS (relay liveness).
MIGRATION_LOCK_CLASS = 0x6F6279

_FILE = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")

# The line after which a migration's statements run outside its transaction.
OUTSIDE_A_TRANSACTION = "-- outside a transaction --"

# How long one attempt at a lock waits in PostgreSQL's queue, with the application's
# INSERTs queued behind it, before it lets them go and tries again (seconds).
LOCK_TIMEOUT = 0.5
# A concurrent index build blocks no INSERT, so it may wait longer before it gives
# up (each try of a build that gave up starts it again, scanning the table again).
CONCURRENT_LOCK_TIMEOUT = 5.0
# Pauses between attempts (seconds): short at first, so that a lock held for a
# moment is taken at once, growing while something holds it for long.
RETRY_PAUSE_INITIAL = 0.2
RETRY_PAUSE_MAX = 2.0
# How often the server checks, during a statement, that ``outbox init`` is still
# there (PostgreSQL >= 14); a killed one then leaves the lock queue.
CLIENT_CHECK_INTERVAL = "1s"
# Most holders of a lock named in one line.
SAY_HOLDERS = 3
# How often the claims of relays queued behind an attempt are looked for (seconds).
_YIELD_POLL = 0.05
# The watch's statements (a look at pg_stat_activity, a cancel) are quick.
WATCH_STATEMENT_TIMEOUT = 10.0

_CONCURRENT_INDEX = re.compile(
    r"^CREATE\s+(?:UNIQUE\s+)?INDEX\s+CONCURRENTLY\s+IF\s+NOT\s+EXISTS\s+\{(\w+)\}",
    re.IGNORECASE,
)


@dataclasses.dataclass(frozen=True)
class Migration:
    version: int
    name: str
    text: str

    @property
    def in_transaction(self) -> str:
        """The statements applied in one transaction."""
        return self.text.split(OUTSIDE_A_TRANSACTION, 1)[0]

    @property
    def outside_a_transaction(self) -> list[str]:
        """The statements applied each on its own after the transaction, in order.

        One statement per ``;`` at a line's end; no function bodies here.
        """
        if OUTSIDE_A_TRANSACTION not in self.text:
            return []
        text = self.text.split(OUTSIDE_A_TRANSACTION, 1)[1]
        lines = [line for line in text.splitlines() if not line.lstrip().startswith("--")]
        statements = re.split(r";\s*$", "\n".join(lines), flags=re.MULTILINE)
        return [" ".join(s.split()) for s in statements if s.strip()]


@dataclasses.dataclass(frozen=True)
class Holder:
    """Something that holds a lock a migration step waits for."""

    relation: str
    gid: str | None  # a prepared transaction
    pid: int | None  # a session
    application_name: str
    state: str
    seconds: float  # how long its transaction has been open (or prepared)


@dataclasses.dataclass(frozen=True)
class Blocked:
    """A migration step gave its place in the lock queue up after ``LOCK_TIMEOUT``."""

    step: str
    attempt: int
    waited: float  # seconds since the step's first attempt
    holders: tuple[Holder, ...]
    relay_claims_cancelled: int  # relay claims queued behind it, cancelled so far
    relay_claims_refused: str = ""  # why some could not be cancelled


OnBlocked = Callable[[Blocked], None]


def migrations() -> list[Migration]:
    folder = resources.files("outbox.db").joinpath("schema")
    found = []
    for entry in folder.iterdir():
        match = _FILE.match(entry.name)
        if match:
            found.append(Migration(int(match.group(1)), entry.name, entry.read_text("utf-8")))
    return sorted(found, key=lambda m: m.version)


LATEST_VERSION = migrations()[-1].version


def _version_table_sql(table: str) -> sql.Composed:
    return sql.SQL(
        "CREATE TABLE IF NOT EXISTS {schema_version} ("
        " version integer PRIMARY KEY,"
        " name text NOT NULL,"
        " applied_at timestamptz NOT NULL DEFAULT now())"
    ).format(schema_version=table_identifiers(table)["schema_version"])


def _composed(table: str, text: str) -> sql.Composed:
    return sql.SQL(text).format(**table_identifiers(table))


def _in_one_transaction(statement: str) -> str:
    """A statement of the outside part, as it runs inside a transaction."""
    return re.sub(r"\bCONCURRENTLY\s+", "", statement, count=1, flags=re.IGNORECASE)


def _version_row(table: str, migration: Migration) -> sql.Composed:
    return sql.SQL("INSERT INTO {} (version, name) VALUES ({}, {}) ON CONFLICT DO NOTHING").format(
        table_identifiers(table)["schema_version"],
        sql.Literal(migration.version),
        sql.Literal(migration.name),
    )


def render_sql(table: str) -> str:
    """The whole schema as one script, for teams that run their own migrations.

    Each migration is a transaction under ``lock_timeout`` (rerun the script when
    one gives up: every statement is idempotent), then its concurrent index builds.
    Its version row is written only if that transaction committed in this session
    (it sets ``outbox.migrated``, which a rollback undoes) and its indexes are valid:
    a tool that goes on after an error (psql without ON_ERROR_STOP) cannot record
    a migration that failed.  And a migration's transaction fails at once unless
    the one before is recorded: one that takes no lock on the outbox (0005 only
    replaces a function) would otherwise commit after an earlier one failed, and
    its version row would say the schema is newer than it is.
    """
    millis = round(LOCK_TIMEOUT * 1000)
    parts = [
        f"-- outbox schema for table {table!r}, version {LATEST_VERSION}",
        "-- Online: run it with psql -v ON_ERROR_STOP=1 and run it again when a lock",
        f"-- timeout ({millis} ms) stops it; a CREATE INDEX CONCURRENTLY that fails leaves an",
        "-- invalid index: DROP INDEX CONCURRENTLY it before running the script again.",
        f"SET lock_timeout = '{millis}ms';",
        _version_table_sql(table).as_string(None) + ";",
    ]
    for migration in migrations():
        parts.append(f"-- {migration.name}")
        parts.append("BEGIN;")
        if migration.version > 1:
            parts.append(_script_requires_previous(table, migration).as_string(None) + ";")
        parts.append(_composed(table, migration.in_transaction).as_string(None).strip())
        parts.append(
            f"DO $$ BEGIN PERFORM set_config('{_SCRIPT_MIGRATED}', "
            f"'{migration.version}', false); END $$;"
        )
        parts.append("COMMIT;")
        parts.extend(
            _composed(table, statement).as_string(None) + ";"
            for statement in migration.outside_a_transaction
        )
        parts.append(_script_version_row(table, migration).as_string(None) + ";")
    return "\n".join(parts) + "\n"


# The setting by which a script's migration says that its transaction committed.
_SCRIPT_MIGRATED = "outbox.migrated"


def _script_requires_previous(table: str, migration: Migration) -> sql.Composed:
    """Fail the script's transaction of ``migration`` unless the one before is recorded."""
    message = (
        f"outbox schema: migration {migration.version - 1} is not applied, so "
        f"{migration.name} is skipped; run the script again"
    )
    return sql.SQL(
        "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM {} WHERE version = {}) THEN "
        "RAISE EXCEPTION {}; END IF; END $$"
    ).format(
        table_identifiers(table)["schema_version"],
        sql.Literal(migration.version - 1),
        sql.Literal(message),
    )


def _script_version_row(table: str, migration: Migration) -> sql.Composed:
    """The version row of ``render_sql``: only after the migration's transaction
    committed and with each index it builds concurrently there and valid."""
    indexes = [
        sql.SQL("to_regclass({})").format(
            sql.Literal(table_identifiers(table)[match.group(1)].as_string(None))
        )
        for match in map(_CONCURRENT_INDEX.match, migration.outside_a_transaction)
        if match
    ]
    condition = sql.SQL("current_setting({}, true) = {}").format(
        sql.Literal(_SCRIPT_MIGRATED), sql.Literal(str(migration.version))
    )
    if indexes:
        condition += sql.SQL(
            " AND (SELECT count(*) FROM pg_index WHERE indisvalid AND indexrelid IN ({})) = {}"
        ).format(sql.SQL(", ").join(indexes), sql.Literal(len(indexes)))
    return sql.SQL(
        "INSERT INTO {} (version, name) SELECT {}, {} WHERE {} ON CONFLICT DO NOTHING"
    ).format(
        table_identifiers(table)["schema_version"],
        sql.Literal(migration.version),
        sql.Literal(migration.name),
        condition,
    )


def current_version(conn: psycopg.Connection[object], table: str) -> int | None:
    """The applied schema version, or None when the outbox was never initialised."""
    cur = conn.cursor(row_factory=tuple_row)
    row = cur.execute("SELECT to_regclass(%s) IS NOT NULL", [f"{table}_schema_version"]).fetchone()
    if not row or not row[0]:
        return None
    version = cur.execute(
        sql.SQL("SELECT max(version) FROM {}").format(table_identifiers(table)["schema_version"])
    ).fetchone()
    return int(version[0]) if version and version[0] is not None else None


def version_of(store: session.Session) -> int | None:
    """``current_version`` on a store's session, driver errors translated (a lost or
    silent session is ``DatabaseUnavailable``, not a traceback)."""
    with session.translated(
        store.conn,
        "reading the schema version",
        statement_timeout=store.statement_timeout,
        lock_timeout=store.lock_timeout,
    ):
        return current_version(store.conn, store.table)


def require_current(version: int | None, table: str) -> None:
    """Raise unless ``version`` is the one this code was written for."""
    if version is None:
        raise SchemaNotReady(
            f"the outbox table {table!r} has not been created in this database",
            "run `outbox init` (or apply `outbox init --print-sql`)",
        )
    if version < LATEST_VERSION:
        raise SchemaNotReady(
            f"the outbox schema is at version {version}, this relay needs {LATEST_VERSION}",
            "run `outbox init` to upgrade it",
        )
    refuse_newer(version, table)


def refuse_newer(version: int | None, table: str) -> None:
    """A newer outbox-relay migrated this schema: this one cannot know what changed."""
    if version is not None and version > LATEST_VERSION:
        raise SchemaTooNew(
            f"the schema of {table!r} is at version {version}, newer than this outbox-relay "
            f"knows (version {LATEST_VERSION})",
            "run the outbox-relay release that migrated it, or a newer one; "
            "never downgrade a schema by hand",
        )


def migrate(
    conn: psycopg.Connection[object],
    table: str,
    *,
    on_blocked: OnBlocked | None = None,
    before_changes: Callable[[], None] | None = None,
    target: int | None = None,
) -> tuple[int | None, int]:
    """Apply the missing migrations; returns (version before, version after).

    Refuses (``SchemaTooNew``) a schema newer than this code, changing nothing.
    An up-to-date schema is left alone, so any role that may read the version
    table may run ``outbox init``; changing the schema takes the right to create
    tables in the schema and ownership of the existing ones (``MissingPrivileges``
    names them otherwise).

    On a connection in autocommit mode the migration is online (module docstring):
    each time a step gives its place in the lock queue up, ``on_blocked`` hears
    what holds the lock, and the step is tried again until it succeeds;
    ``before_changes`` runs once before the first change to an existing schema
    (``outbox init`` resolves dead relays' batches there).  Inside a
    transaction everything runs in that transaction.  ``target`` stops at that
    version (tests build earlier schemas with it).
    """
    target = LATEST_VERSION if target is None else target
    try:
        if conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
            return _Online(conn, table, on_blocked, before_changes).run(target)
        return _in_transaction(conn, table, target)
    except psycopg.errors.InsufficientPrivilege as exc:
        text = str(exc).strip().splitlines()[0]
        raise MissingPrivileges(
            f"PostgreSQL refused the schema change: {text}",
            "run `outbox init` as the owner of the outbox tables (docs/reference/privileges.md)",
        ) from exc


def _lock_key(table: str) -> list[int]:
    return [MIGRATION_LOCK_CLASS, zlib.crc32(table.encode()) & 0x7FFFFFFF]


def _in_transaction(
    conn: psycopg.Connection[object], table: str, target: int
) -> tuple[int | None, int]:
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", _lock_key(table))
        before = current_version(conn, table)
        refuse_newer(before, table)
        if before is not None and before >= target:
            return before, before
        _check_may_migrate(conn, table)
        conn.execute(_version_table_sql(table))
        for migration in _pending(before, target):
            conn.execute(_composed(table, migration.in_transaction))
            for statement in migration.outside_a_transaction:
                conn.execute(_composed(table, _in_one_transaction(statement)))
            conn.execute(_version_row(table, migration))
    return before, target


def _pending(before: int | None, target: int) -> list[Migration]:
    return [m for m in migrations() if (before or 0) < m.version <= target]


class _Online:
    """One online migration on an autocommit connection (module docstring)."""

    def __init__(
        self,
        conn: psycopg.Connection[object],
        table: str,
        on_blocked: OnBlocked | None,
        before_changes: Callable[[], None] | None,
    ) -> None:
        self.conn = conn
        self.table = table
        self.on_blocked = on_blocked
        self.before_changes = before_changes
        self.tables = [
            f"{table}_schema_version",
            f"{table}_relays",
            f"{table}_dead_letters",
            table,
        ]

    def run(self, target: int) -> tuple[int | None, int]:
        """Migrate under the session settings of an online migration; the
        connection's own settings are back afterwards (it may be Django's)."""
        settings = {
            "statement_timeout": "0",
            "lock_timeout": f"{round(LOCK_TIMEOUT * 1000)}ms",
        }
        if self.conn.info.server_version >= 140000:
            settings["client_connection_check_interval"] = CLIENT_CHECK_INTERVAL
        saved = {name: self._set(name, value) for name, value in settings.items()}
        try:
            # Without statement_timeout, a silent server may be building an index.
            with session.without_deadline(self.conn):
                return self._locked(target)
        finally:
            if not self.conn.closed and not self.conn.broken:
                for name, value in saved.items():
                    self._set(name, value)

    def _set(self, name: str, value: str) -> str:
        """Set a session setting; returns the value it had."""
        cur = self.conn.cursor(row_factory=tuple_row)
        row = cur.execute(
            "SELECT current_setting(%s), set_config(%s, %s, false)", [name, name, value]
        ).fetchone()
        assert row is not None
        return str(row[0])

    def _locked(self, target: int) -> tuple[int | None, int]:
        conn = self.conn
        self._retried(
            "waiting for another outbox init to finish",
            lambda: conn.execute("SELECT pg_advisory_lock(%s, %s)", _lock_key(self.table)),
            migration_lock=True,
        )
        try:
            before = current_version(conn, self.table)
            refuse_newer(before, self.table)
            if before is not None and before >= target:
                return before, before
            _check_may_migrate(conn, self.table)
            if before is not None and self.before_changes is not None:
                self.before_changes()
            self._retried(
                "creating the schema version table",
                lambda: conn.execute(_version_table_sql(self.table)),
            )
            for migration in _pending(before, target):
                self._apply(migration)
            return before, target
        finally:
            if not conn.closed and not conn.broken:
                conn.execute("SELECT pg_advisory_unlock(%s, %s)", _lock_key(self.table))

    def _apply(self, migration: Migration) -> None:
        def in_transaction() -> None:
            with self.conn.transaction(), _YieldToRelays(self.conn):
                self.conn.execute(_composed(self.table, migration.in_transaction))

        self._retried(f"migration {migration.name}", in_transaction)
        for statement in migration.outside_a_transaction:
            self._concurrently(migration, statement)
        self._retried(
            f"recording migration {migration.name}",
            lambda: self.conn.execute(_version_row(self.table, migration)),
        )

    def _concurrently(self, migration: Migration, statement: str) -> None:
        index = _CONCURRENT_INDEX.match(statement)

        def build() -> None:
            if index:
                self._drop_if_invalid(table_identifiers(self.table)[index.group(1)])
            self.conn.execute(_composed(self.table, statement))

        what = f"index {index.group(1)}" if index else statement.split(" (")[0]
        self._set("lock_timeout", f"{round(CONCURRENT_LOCK_TIMEOUT * 1000)}ms")
        try:
            self._retried(f"migration {migration.name}: {what}", build, concurrent=True)
        finally:
            self._set("lock_timeout", f"{round(LOCK_TIMEOUT * 1000)}ms")

    def _drop_if_invalid(self, index: sql.Identifier) -> None:
        """Drop the invalid index a failed or killed ``CREATE INDEX CONCURRENTLY`` left."""
        row = (
            self.conn.cursor(row_factory=tuple_row)
            .execute(
                "SELECT NOT i.indisvalid FROM pg_index i WHERE i.indexrelid = to_regclass(%s)",
                [index.as_string(self.conn)],
            )
            .fetchone()
        )
        if row and row[0]:
            self.conn.execute(sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(index))

    def _retried(
        self,
        step: str,
        attempt: Callable[[], object],
        *,
        concurrent: bool = False,
        migration_lock: bool = False,
    ) -> None:
        started = time.monotonic()
        for number in _attempts():
            try:
                attempt()
                return
            except pgerrors.LockNotAvailable:
                pass
            if self.on_blocked is not None:
                self.on_blocked(
                    Blocked(
                        step=step,
                        attempt=number,
                        waited=time.monotonic() - started,
                        holders=tuple(self._holders(concurrent, migration_lock)),
                        relay_claims_cancelled=_YieldToRelays.cancelled,
                        relay_claims_refused=_YieldToRelays.refused,
                    )
                )
            time.sleep(retry_pause(number))

    def _holders(self, concurrent: bool, migration_lock: bool = False) -> Iterator[Holder]:
        """What holds a lock on the outbox's tables (or the migration lock) now;
        for a concurrent index build, the transactions of the database it waits for
        (``_OLD_TRANSACTIONS``); for the migration lock, only the
        other ``outbox init`` that holds it.

        Sessions show only when their transaction is older than twice
        ``LOCK_TIMEOUT``: the application's short transactions come and go.  The
        other init holds the migration lock between short statements, so it shows
        whatever its transaction's age.
        """
        cur = self.conn.cursor(row_factory=tuple_row)
        if concurrent:
            rows = cur.execute(_OLD_TRANSACTIONS, {"tables": self.tables}).fetchall()
        else:
            lock_class, lock_key = _lock_key(self.table)
            rows = cur.execute(
                session.LOCK_HOLDERS,
                {
                    "tables": self.tables,
                    "lock_class": lock_class,
                    "lock_key": lock_key,
                    "lock_name": _MIGRATION_LOCK,
                },
            ).fetchall()
        for relation, gid, pid, name, state, seconds in rows:
            if migration_lock != (relation == _MIGRATION_LOCK):
                continue
            if (
                not migration_lock
                and gid is None
                and (seconds is None or float(seconds) < 2 * LOCK_TIMEOUT)
            ):
                # A short transaction, one that ended since, or one that waited
                # behind this attempt (for up to LOCK_TIMEOUT) and runs now.
                continue
            yield Holder(
                relation=relation,
                gid=gid,
                pid=pid,
                application_name=name or "",
                state=state or "",
                seconds=float(seconds or 0),
            )


# How a holder of the migration's advisory lock is named (``Holder.relation``).
_MIGRATION_LOCK = "the migration lock"

# What a concurrent index build waits for: the transactions of this database that
# started before it and hold a snapshot (backend_xmin) or a lock on the outbox's
# tables, prepared ones included.  A session idle in a READ COMMITTED transaction
# holds neither (a pooled connection left so): the build does not wait for it.
_OLD_TRANSACTIONS = """
SELECT 'this database', p.gid, NULL::int, NULL, NULL,
       greatest(0, extract(epoch FROM now() - p.prepared))
FROM pg_prepared_xacts p WHERE p.database = current_database()
UNION ALL
SELECT 'this database', NULL, a.pid, a.application_name, a.state,
       greatest(0, extract(epoch FROM now() - a.xact_start))
FROM pg_stat_activity a
WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
  AND a.xact_start IS NOT NULL AND a.backend_type = 'client backend'
  AND (a.backend_xmin IS NOT NULL
       OR EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.relation
                  = ANY(ARRAY(SELECT to_regclass(t) FROM unnest(%(tables)s::text[]) t))))
ORDER BY 6 DESC
"""


def _attempts() -> Iterator[int]:
    number = 0
    while True:
        number += 1
        yield number


def retry_pause(attempt: int) -> float:
    """Seconds before attempt ``attempt + 1``: doubling from RETRY_PAUSE_INITIAL, jittered."""
    pause = min(RETRY_PAUSE_MAX, RETRY_PAUSE_INITIAL * 2.0 ** min(attempt - 1, 10))
    return pause * random.uniform(0.5, 1.0)


class _YieldToRelays:
    """While an attempt waits for its locks, cancel relay claims queued behind it.

    A pipelined relay claims its next batch before it commits the one in flight.
    Queued behind our DDL, that claim cannot return, so the batch in flight, which
    our DDL waits for, is never committed: each would wait for the other until a
    timeout.  Cancelling the claim (a statement of an open, unprepared transaction
    that has not got its lock yet) rolls it back; the relay finishes its batch in
    flight, backs off and claims again after our DDL.  Only backends of relays
    (``application_name`` ``outbox-relay…``) waiting for a lock that our session
    holds or waits for are cancelled, and only while our statement runs.
    """

    cancelled = 0  # over the process: reported in ``Blocked``
    refused = ""  # why a claim could not be cancelled (the last time): reported too

    def __init__(self, conn: psycopg.Connection[object]) -> None:
        self.pid = conn.info.backend_pid
        self.conninfo = psycopg.conninfo.make_conninfo(
            conn.info.dsn, password=conn.info.password, application_name="outbox-init-watch"
        )
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="outbox-init-watch", daemon=True)

    def __enter__(self) -> _YieldToRelays:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        self.thread.join()

    def _watch(self) -> None:
        try:
            # Bounded as every session (outbox.db.session.connect): a watch that
            # waits for nothing, but whose server may stall.
            watch: psycopg.Connection[Any] = session.connect(
                self.conninfo,
                application_name="outbox-init-watch",
                statement_timeout=WATCH_STATEMENT_TIMEOUT,
                client_deadline=True,  # __exit__ joins this thread
            )
            watch.row_factory = tuple_row
            with watch:
                while not self.stop.wait(_YIELD_POLL):
                    queued = watch.execute(
                        "SELECT pid, usename FROM pg_stat_activity"
                        " WHERE %s = ANY(pg_blocking_pids(pid))"
                        " AND application_name LIKE 'outbox-relay%%'",
                        [self.pid],
                    ).fetchall()
                    for pid, role in queued:
                        self._cancel(watch, pid, role)
        except (psycopg.Error, DatabaseUnavailable):
            # Without the watch (no second connection) each attempt still ends at
            # its lock_timeout: slower beside busy relays, never stuck.
            return

    def _cancel(self, watch: psycopg.Connection[Any], pid: int, role: str) -> None:
        try:
            row = watch.execute("SELECT pg_cancel_backend(%s)", [pid]).fetchone()
        except pgerrors.InsufficientPrivilege as exc:
            _YieldToRelays.refused = (
                f"may not cancel the claims of relays running as {role!r} "
                f"({str(exc).strip().splitlines()[0]}): run outbox init as that role, "
                "or GRANT pg_signal_backend to its role"
            )
            return
        if row and row[0]:
            _YieldToRelays.cancelled += 1


def describe_wait(blocked: Blocked, table: str, unsettled: str = "") -> str:
    """What a waiting step waits for, and what settles it, in one line."""
    parts = [describe_holder(h, table, unsettled) for h in blocked.holders[:SAY_HOLDERS]]
    if len(blocked.holders) > SAY_HOLDERS:
        parts.append(f"{len(blocked.holders) - SAY_HOLDERS} more")
    if not parts:
        parts = ["locks held for a moment by the application's or the relays' transactions"]
    line = f"{blocked.step}: waiting for " + "; ".join(parts)
    if blocked.relay_claims_cancelled:
        line += (
            f" ({blocked.relay_claims_cancelled} relay claims queued behind it cancelled "
            "so far; the relays retry them)"
        )
    if blocked.relay_claims_refused:
        line += f" (this init {blocked.relay_claims_refused})"
    return line


def describe_holder(holder: Holder, table: str, unsettled: str = "") -> str:
    age = f"{holder.seconds:.0f} s"
    if holder.gid is not None:
        parsed = gids.parse(holder.gid)
        if parsed is None or parsed.table != table:
            return (
                f"prepared transaction {holder.gid!r} ({age} old, not a relay batch of "
                f"{table!r}) on {holder.relation}: its owner must finish it "
                "(COMMIT PREPARED or ROLLBACK PREPARED)"
            )
        text = (
            f"prepared batch {holder.gid!r} ({age} old) on {holder.relation}: a running "
            "relay or `outbox resolve` settles it"
        )
        if unsettled:
            text += f" (this init could not: {unsettled})"
        return text
    name = holder.application_name or "no application_name"
    if holder.relation == _MIGRATION_LOCK:
        return f"another outbox init (pid {holder.pid}, {name}) to finish"
    return (
        f"session pid {holder.pid} ({name}, {holder.state}, transaction open {age}) on "
        f"{holder.relation}: it must commit or roll back"
    )


def _check_may_migrate(conn: psycopg.Connection[object], table: str) -> None:
    """Raise ``MissingPrivileges`` unless this role may create the tables in its
    schema and owns (or is a member of the owner of) those that exist."""
    names = [
        privileges.table_name(table, role)
        for role in (
            privileges.OUTBOX,
            privileges.RELAYS,
            privileges.DEAD_LETTERS,
            privileges.SCHEMA_VERSION,
        )
    ]
    cur = conn.cursor(row_factory=tuple_row)
    row = cur.execute(
        "SELECT current_user, current_schema(),"
        " coalesce(has_schema_privilege(current_schema(), 'CREATE'), false),"
        " array(SELECT c.relname::text FROM pg_class c"
        "       WHERE c.oid = ANY(array(SELECT to_regclass(n) FROM unnest(%s::text[]) n))"
        "         AND NOT pg_has_role(c.relowner, 'USAGE') ORDER BY 1)",
        [names],
    ).fetchone()
    assert row is not None
    role, schema, may_create, not_owned = row
    if not may_create:
        raise MissingPrivileges(
            f"the database role {role!r} may not create tables in schema {schema!r}",
            f"as its owner, run: GRANT CREATE ON SCHEMA {schema} TO "
            f"{privileges.quote_role(role)}; or run `outbox init` as the tables' owner",
        )
    if not_owned:
        raise MissingPrivileges(
            f"the database role {role!r} does not own {', '.join(not_owned)}: "
            "upgrading the schema alters them",
            "run `outbox init` as their owner",
        )
