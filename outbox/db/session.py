"""One PostgreSQL session mechanism for every store: connect, bound statements,
tell a lost session from a refused statement, and translate driver errors.

Driver exceptions never leave ``outbox.db``: ``translated`` turns them into
``outbox.errors`` types (``DatabaseUnavailable`` when the session is gone,
``StatementTimedOut``, ``MissingPrivileges``, ``DatabaseRefused`` with the
server's first line otherwise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pgerrors
from psycopg import pq, waiting
from psycopg.abc import PQGen
from psycopg.rows import dict_row

from outbox import gid as gids
from outbox.config import Settings
from outbox.db import privileges
from outbox.db.queries import Queries
from outbox.errors import (
    CommitAwaitsStandby,
    DatabaseRefused,
    DatabaseUnavailable,
    MissingPrivileges,
    OutboxError,
    StatementTimedOut,
)

Row = dict[str, Any]
Conn = psycopg.Connection[Row]


# How long past its ``statement_timeout`` a statement of a session with a client
# deadline (``connect(client_deadline=True)``) may go without a byte from PostgreSQL
# before the client gives the session up (``DeadlineConnection``): at least
# ``SILENCE_MARGIN`` seconds, half the timeout for long ones.  The server's own answer
# (its statement_timeout or lock_timeout error, which names what held the statement)
# must win whenever the server still answers, so the margin covers what may delay that
# answer: the round trip, and a loaded server or client scheduled seconds late.
SILENCE_MARGIN = 2.0


def silence_limit(statement_timeout: float) -> float:
    """How long a statement's wait may hear nothing before the session is given up."""
    return statement_timeout + max(SILENCE_MARGIN, statement_timeout / 2)


class ServerSilent(psycopg.OperationalError):
    """PostgreSQL sent nothing for ``silence_limit`` seconds during a statement; the
    client closed the connection (the statement's outcome is unknown)."""


class ServerTooSlow(ServerSilent):
    """PostgreSQL's answer to a statement kept coming, too slowly to be complete within
    ``ANSWER_FACTOR`` times ``silence_limit`` seconds; the client closed the connection."""


class StandbyWait(ServerSilent):
    """Nothing came during a statement because its commit waits for a synchronous
    standby (the backend's ``wait_event`` is ``SyncRep``): the change is committed on
    the primary (in its WAL), seen by other sessions once a standby confirms it or
    ``synchronous_standby_names`` no longer asks for one; the backend keeps waiting
    after the client closed the connection (that wait ends only so)."""

    def __init__(self, message: str, standbys: str) -> None:
        super().__init__(message)
        self.standbys = standbys


def hint_for(exc: BaseException) -> str:
    """The hint of a ``DatabaseUnavailable`` raised for ``exc``, if it has its own."""
    if isinstance(exc, StandbyWait):
        return (
            "the change takes effect for other sessions once a synchronous standby "
            "confirms it: bring the standby back, or change synchronous_standby_names "
            "to standbys that run; running the command again is safe"
        )
    if isinstance(exc, ServerTooSlow):
        return (
            "look for a network path that throttles or drops traffic (a proxy, a load "
            "balancer) or an overloaded server; then try again"
        )
    if isinstance(exc, ServerSilent):
        return (
            "look for a stopped server or backend, or a network path that drops traffic "
            "(a firewall, a load balancer); then try again"
        )
    return ""


class _Silence(Exception):
    """Raised inside a wait by ``DeadlineConnection._heard`` (never leaves the wait)."""


class _Overdue(Exception):
    """Raised inside a wait by ``DeadlineConnection._heard`` or ``_until`` (never
    leaves the wait)."""


RV = TypeVar("RV")
# How often a wait wakes up with nothing to read (psycopg's own interval): how late
# at most a silence is noticed.
WAIT_INTERVAL = 0.1
# The bound on one statement's whole wait (its answer included), as a multiple of its
# silence limit, however the answer keeps coming: a live server's statement, the
# output it sends included, ends within its statement_timeout (the server cancels it
# then), so its complete answer is in within statement_timeout and a round trip.
# Twice the silence limit (e.g. 6 s for a 1 s statement_timeout) leaves as much again
# for a loaded server or a slow link; an answer still incomplete then is a path (or a
# server) that dribbles, which would otherwise hold the command for as long as it
# dribbles, since each byte restarts the silence count.  A session that lifts its
# statement_timeout must lift the deadline too (``without_deadline``).
ANSWER_FACTOR = 2.0
# After Ctrl-C during a statement: how long the client tries to have the server cancel
# it (the cancel request, then the server's answer to it) before closing the session.
INTERRUPT_GRACE = 2.0
# The second session that asks, once a statement's silence limit has passed, what its
# backend waits for: its connect timeout (libpq's smallest useful one) and its own
# silence limit.
PROBE_CONNECT_TIMEOUT = 2
PROBE_SILENCE = 1.0
_WAITS_ON = """
SELECT wait_event, current_setting('synchronous_standby_names') AS standbys
FROM pg_stat_activity WHERE pid = %s
"""


class DeadlineConnection(psycopg.Connection[Row]):
    """A connection that does not wait for ever for a server that stopped answering.

    ``statement_timeout`` and ``lock_timeout`` are enforced by the server, whose
    answer never comes from a stopped backend, a frozen host or a network path that
    drops traffic while something still acknowledges it (a stateful firewall, a load
    balancer: TCP keepalives and ``tcp_user_timeout`` then see nothing wrong).  So
    each wait for a statement's answer (the session ``ACTIVE``) fails once nothing
    has come from the server for ``silence`` seconds: the connection is closed
    (``pgconn.finish``) and ``ServerSilent`` raised, which ``translated`` reports as
    ``DatabaseUnavailable``.  Data arriving restarts the count, so a long result
    keeps going, up to ``ANSWER_FACTOR`` times ``silence`` for the whole wait
    (``ServerTooSlow``: an answer that trickles in).  Before giving a silent session
    up, a short second session (``probe_dsn``) asks what its backend waits for: a
    commit waiting for a synchronous standby, which ``statement_timeout`` does not
    bound, raises ``StandbyWait`` instead.  Waits psycopg bounds itself
    (``notifies(timeout=…)``, an idle session's ``notifies()``) and pipeline mode
    (one wait for several statements, each with its own ``statement_timeout``) are
    not bounded here.

    Ctrl-C (or ``SystemExit``) during a statement is handled here rather than by
    psycopg, which logs through the ``psycopg`` logger (a line operator commands
    would print as is) and waits again, up to 5 s, on the same deadline: the server
    is asked to cancel the statement and its answer awaited for ``INTERRUPT_GRACE``
    at most, quietly; the connection is closed unless that answer came.
    """

    silence: float | None = None
    # The DSN (password included) the connection was opened with, for the probe.
    probe_dsn: str | None = None

    # psycopg's ``Connection.wait`` (undocumented, every statement's wait goes through
    # it) is the one place a deadline per wait fits; psycopg has none of its own.
    # .ci/matrix runs tests/integration/db/test_session_deadline.py on the oldest
    # and newest psycopg allowed.
    def wait(
        self, gen: PQGen[RV], interval: float = WAIT_INTERVAL, timeout: float | None = None
    ) -> RV:
        silence = self.silence
        if (
            silence is None
            or timeout is not None
            or self.pgconn.pipeline_status != pq.PipelineStatus.OFF
        ):
            if timeout is None:  # psycopg before 3.3.6 has no ``timeout`` (nor passes one)
                return super().wait(gen, interval)
            return super().wait(gen, interval, timeout)
        heard = self._heard(gen, silence)
        try:
            return waiting.wait(heard, self.pgconn.socket, interval=interval)
        except _Silence:
            raise self._silent(silence) from None
        except _Overdue:
            self.pgconn.finish()
            raise ServerTooSlow(
                "the answer to a statement kept coming from PostgreSQL too slowly: still "
                f"incomplete after {ANSWER_FACTOR * silence:g} s; the connection was closed"
            ) from None
        except (KeyboardInterrupt, SystemExit):
            self._interrupted(heard, interval)
            raise

    def _heard(self, gen: PQGen[RV], silence: float) -> PQGen[RV]:
        """``gen``, failing with ``_Silence`` once a statement in flight has heard
        nothing for ``silence`` seconds (the wait wakes up every ``interval``), and with
        ``_Overdue`` once it has been in flight for ``ANSWER_FACTOR`` times ``silence``."""
        pgconn = self.pgconn
        limit = ANSWER_FACTOR * silence
        heard = began = time.monotonic()
        try:
            wanted = next(gen)
            while True:
                ready = yield wanted
                now = time.monotonic()
                active = pgconn.transaction_status == pq.TransactionStatus.ACTIVE
                if not active:
                    heard = began = now
                elif ready:
                    heard = now
                elif now - heard >= silence:
                    gen.close()
                    raise _Silence
                # What arrived first: it may complete the answer (StopIteration).
                wanted = gen.send(ready)
                if active and now - began >= limit:
                    gen.close()
                    raise _Overdue
        except StopIteration as done:
            result: RV = done.value
            return result

    def _silent(self, silence: float) -> ServerSilent:
        """The error for a statement silent for ``silence`` seconds, the connection
        closed: ``StandbyWait`` if its backend waits for a synchronous standby."""
        try:
            standbys = self._standbys_awaited(self.pgconn.backend_pid)
        finally:
            self.pgconn.finish()
        if standbys is not None:
            return StandbyWait(
                "the change is committed on the primary, but its commit waits for a "
                f"synchronous standby (synchronous_standby_names = {standbys!r}); "
                f"nothing came for {silence:g} s, the connection was closed",
                standbys,
            )
        return ServerSilent(
            f"nothing came from PostgreSQL for {silence:g} s during a statement; "
            "the connection was closed"
        )

    def _standbys_awaited(self, pid: int) -> str | None:
        """``synchronous_standby_names`` if backend ``pid`` waits for a synchronous
        standby (``wait_event`` ``SyncRep``), as a short second session sees it; None
        if it waits for something else or that cannot be told."""
        if self.probe_dsn is None:
            return None
        try:
            probe = DeadlineConnection.connect(
                self.probe_dsn,
                autocommit=True,
                row_factory=dict_row,
                application_name="outbox-probe",
                connect_timeout=PROBE_CONNECT_TIMEOUT,
            )
        except psycopg.Error:
            return None
        try:
            probe.silence = PROBE_SILENCE  # its own deadline, without a probe
            row = probe.execute(_WAITS_ON, [pid]).fetchone()
        except psycopg.Error:
            return None
        finally:
            probe.close()
        if row is None or row["wait_event"] != "SyncRep":
            return None
        return str(row["standbys"])

    def _interrupted(self, gen: PQGen[Any], interval: float) -> None:
        """After Ctrl-C during a statement (``gen`` its wait): have the server cancel
        it, so that it does not run on once the command has ended, within
        ``INTERRUPT_GRACE``, quietly; close the connection unless the server answered."""
        pgconn = self.pgconn
        if pgconn.transaction_status != pq.TransactionStatus.ACTIVE:
            return
        ends = time.monotonic() + INTERRUPT_GRACE
        try:
            self.cancel_safe(timeout=INTERRUPT_GRACE)
            # The server's answer (57014), which comes once it has cancelled; a
            # second Ctrl-C meanwhile ends the wait, as it should.
            waiting.wait(_until(gen, ends), pgconn.socket, interval=interval)
        except Exception:  # the interrupt is what gets reported, not this
            pass
        finally:
            if pgconn.transaction_status in (
                pq.TransactionStatus.ACTIVE,
                pq.TransactionStatus.UNKNOWN,
            ):
                pgconn.finish()


def _until(gen: PQGen[RV], ends: float) -> PQGen[RV]:
    """``gen``, failing with ``_Overdue`` once the monotonic clock has passed ``ends``
    with nothing ready (the wait wakes up every ``interval``): psycopg's own wait
    takes a ``timeout`` only from 3.3.6 on."""
    try:
        wanted = next(gen)
        while True:
            ready = yield wanted
            if not ready and time.monotonic() >= ends:
                gen.close()
                raise _Overdue
            wanted = gen.send(ready)
    except StopIteration as done:
        result: RV = done.value
        return result


@contextlib.contextmanager
def without_deadline(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """No client deadline on ``conn`` meanwhile (e.g. while its ``statement_timeout``
    is 0: an online migration's index builds may take long, silent, on a live server)."""
    if not isinstance(conn, DeadlineConnection):
        yield
        return
    saved, conn.silence = conn.silence, None
    try:
        yield
    finally:
        conn.silence = saved


def connect(
    dsn: str,
    *,
    application_name: str,
    connect_timeout: float = 10.0,
    statement_timeout: float | None = None,
    lock_timeout: float | None = None,
    client_deadline: bool = False,
) -> Conn:
    """An autocommit connection, or ``DatabaseUnavailable`` saying what to check.

    The one place where sessions are bounded: with ``statement_timeout`` every
    statement of the session is (``statement_timeout``, and ``lock_timeout`` too
    unless ``lock_timeout`` says otherwise), and the server checks every
    ``CLIENT_CHECK_INTERVAL`` during a statement that the client is still there
    (``client_connection_check_interval``, PostgreSQL ≥ 14): a relay killed during
    a claim no longer leaves its backend running the claim, holding rows and CPU.
    ``lock_timeout`` alone bounds only the waits for locks.

    ``client_deadline`` (with ``statement_timeout``): the client too gives up a
    statement the server has not answered within ``silence_limit(statement_timeout)``
    (``DeadlineConnection``): the operator tools and the console, which a person
    waits for.  The relay and the consumer have their own liveness checks, pipeline
    several statements in one wait and may wait for a synchronous standby on COMMIT
    PREPARED, which ``statement_timeout`` does not bound.
    """
    deadline = client_deadline and statement_timeout is not None
    options = connect_options(application_name=application_name, timeout=connect_timeout)
    try:
        if deadline:
            assert statement_timeout is not None
            bounded = DeadlineConnection.connect(dsn, **options)
            bounded.silence = silence_limit(statement_timeout)
            bounded.probe_dsn = dsn
            conn: Conn = bounded
        else:
            conn = psycopg.connect(dsn, **options)
    except psycopg.OperationalError as exc:
        raise cannot_connect(exc) from exc
    if statement_timeout is not None or lock_timeout is not None:
        try:
            bound_statements(conn, statement_timeout, lock_timeout)
        except psycopg.Error as exc:
            conn.close()
            raise DatabaseUnavailable(
                f"cannot configure the PostgreSQL session: {first_line(exc)}", hint_for(exc)
            ) from exc
    return conn


def connect_options(*, application_name: str, timeout: float) -> dict[str, Any]:
    """The keyword arguments of every session's connect, sync (``psycopg.connect``)
    or async (``psycopg.AsyncConnection.connect``)."""
    return {
        "autocommit": True,
        "row_factory": dict_row,
        "application_name": application_name,
        "connect_timeout": max(1, round(timeout)),
        # Notice a dead server or a cut network in seconds, not hours.
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
    }


def cannot_connect(exc: psycopg.OperationalError) -> DatabaseUnavailable:
    reason = first_line(exc)
    return DatabaseUnavailable(
        f"cannot connect to PostgreSQL: {reason}",
        "the server's certificate must be signed by the CA in sslrootcert= and name "
        "the DSN's host (sslmode=verify-full)"
        if "certificate" in reason
        else f"check {DSN_OPTION} and that the server is running",
    )


# Where a command's DSN comes from, as a hint names it (a fleet's commands name the
# target's line instead: ``outbox.ops.fleet``).
DSN_OPTION = "--dsn / OUTBOX_DSN"


# How often a backend running one of our statements checks that we are still there.
CLIENT_CHECK_INTERVAL = "2s"


def millis(seconds: float) -> str:
    """A timeout for ``set_config``: whole milliseconds, at least 1 (0 would mean none)."""
    return str(max(1, round(seconds * 1000)))


def bound_statements(
    conn: Conn, statement_timeout: float | None, lock_timeout: float | None = None
) -> None:
    lock = lock_timeout if lock_timeout is not None else statement_timeout
    if lock is not None:
        conn.execute("SELECT set_config('lock_timeout', %s, false)", [millis(lock)])
    if statement_timeout is None:
        return
    conn.execute("SELECT set_config('statement_timeout', %s, false)", [millis(statement_timeout)])
    if conn.info.server_version >= 140000:
        conn.execute(
            "SELECT set_config('client_connection_check_interval', %s, false)",
            [CLIENT_CHECK_INTERVAL],
        )


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# Who holds a lock that a statement gave up waiting for, one row per holder
# (``relation``, ``gid``, ``pid``, ``application_name``, ``state``, ``seconds``: the
# age of its transaction): granted locks of this database on %(tables)s, and on the
# advisory lock (%(lock_class)s, %(lock_key)s; NULL: none) named %(lock_name)s, held
# by someone else: a prepared transaction (found through its own transactionid lock,
# which shares its virtualtransaction) or a session.  The one statement of
# ``holders`` here (a statement's lock_timeout), ``outbox init``'s (the migration
# lock, ``outbox.db.migrate``) and the consumer's ``ensure_schema`` (the inbox schema
# lock, ``outbox.db.inbox``); each keeps the holders whose age matters to it.
LOCK_HOLDERS = """
SELECT DISTINCT ON (coalesce(p.gid, l.pid::text))
       coalesce(c.relname::text, %(lock_name)s) AS relation,
       p.gid,
       a.pid,
       coalesce(a.application_name, '') AS application_name,
       coalesce(a.state, '') AS state,
       greatest(0, extract(epoch FROM now() - coalesce(p.prepared, a.xact_start)))::float8
           AS seconds
FROM pg_locks l
LEFT JOIN pg_class c ON c.oid = l.relation
LEFT JOIN pg_locks x ON l.pid IS NULL AND x.locktype = 'transactionid'
     AND x.virtualtransaction = l.virtualtransaction AND x.pid IS NULL
LEFT JOIN pg_prepared_xacts p ON p.transaction = x.transactionid
LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.pid IS DISTINCT FROM pg_backend_pid()
  AND (l.relation = ANY(ARRAY(SELECT to_regclass(t) FROM unnest(%(tables)s::text[]) t))
       OR (l.locktype = 'advisory' AND l.classid::bigint = %(lock_class)s::bigint
           AND l.objid::bigint = %(lock_key)s::bigint AND l.objsubid = 2))
ORDER BY coalesce(p.gid, l.pid::text), c.relname
"""
# The most holders one error line names.
NAMED_HOLDERS = 3


def holders(conn: Conn, tables: Sequence[str], seconds: float) -> list[str]:
    """What holds a lock on ``tables`` (for ``seconds`` or more), one phrase each,
    oldest first, with what settles it; [] if it cannot be told."""
    try:
        cur = conn.cursor(row_factory=dict_row)  # whatever rows the connection gives
        rows = cur.execute(
            LOCK_HOLDERS,
            {"tables": list(tables), "lock_class": None, "lock_key": None, "lock_name": None},
        ).fetchall()
    except psycopg.Error:
        if not (conn.broken or conn.closed):
            with contextlib.suppress(psycopg.Error):
                conn.execute("ROLLBACK")
        return []
    rows = [r for r in rows if r["gid"] is not None or float(r["seconds"] or 0) > seconds]
    rows.sort(key=lambda r: -float(r["seconds"] or 0))
    return [_holder(r) for r in rows]


def _holder(row: Row) -> str:
    age = f"{float(row['seconds'] or 0):.0f} s"
    gid = row["gid"]
    if gid is not None:
        if gids.parse(gid) is None:
            return (
                f"prepared transaction {gid!r} ({age} old, not a relay batch): its owner "
                "must finish it (COMMIT PREPARED or ROLLBACK PREPARED)"
            )
        return (
            f"in-doubt batch {gid!r} ({age} old): resolve it first "
            "(`outbox resolve`, or the console's In-doubt page)"
        )
    name = row["application_name"] or "no application_name"
    return (
        f"session pid {row['pid']} ({name}, {row['state']}, transaction open {age}) "
        f"on {row['relation']}: it must commit or roll back"
    )


@dataclasses.dataclass(frozen=True)
class OperatorBounds:
    """The bounds (s) of an operator's session (a command, the console's request) on
    a quarantine's store: connecting, each statement, each wait for a lock."""

    connect_timeout: float = 10.0
    statement_timeout: float = Settings.statement_timeout
    lock_timeout: float = Settings.lock_timeout


OPERATOR_BOUNDS = OperatorBounds()


@dataclasses.dataclass(frozen=True)
class Hints:
    """How the hints of ``translated``'s errors say to go on, by who runs the
    statement: a daemon (the relay, the consumer) reconnects and retries by itself;
    an operator's command (``dead-letters``, ``parked``, the console's actions on
    them) is neither, and is run again."""

    lost: str  # the session is gone: the statement's outcome is unknown
    failed: str  # the server failed on a live session
    retries: str  # what follows a statement the server cancelled
    refused: str  # a constraint, a trigger, a value the server cannot store

    @classmethod
    def daemon(cls, who: str) -> Hints:
        return cls(
            lost=f"the {who} reconnects by itself; check the server if this repeats",
            failed=f"the {who} retries with backoff; check the server if this repeats",
            retries=f"the {who} retries with backoff",
            refused="look for a constraint or trigger added to the outbox tables; "
            f"the {who} retries with backoff",
        )

    @classmethod
    def operator(cls, lost: str) -> Hints:
        """``lost``: what the command's work came to when its session went."""
        return cls(
            lost=lost,
            failed="run the command again; check the server if this repeats",
            retries="run the command again",
            refused="look for a constraint or trigger added to the outbox tables",
        )


RELAY_HINTS = Hints.daemon("relay")


def timed_out(
    conn: Conn,
    exc: psycopg.Error,
    what: str,
    tables: Sequence[str],
    *,
    statement_timeout: float | None,
    lock_timeout: float | None,
    retries: str = "try again",
) -> StatementTimedOut:
    """``StatementTimedOut`` for a statement PostgreSQL cancelled (``lock_timeout``,
    55P03, or ``statement_timeout``, 57014), naming what held it (``holders``).  The
    session must be out of the failed transaction already."""
    if not isinstance(exc, pgerrors.LockNotAvailable):
        # Not a wait for a lock (that one has its own, shorter bound): a slow plan,
        # a busy server.
        return StatementTimedOut(
            f"PostgreSQL cancelled the statement {what} after {statement_timeout or 0:g} s "
            f"({first_line(exc)})",
            f"{retries}; if this repeats, look for what slows the server "
            "(pg_stat_activity) or raise --statement-timeout",
        )
    seconds = lock_timeout if lock_timeout is not None else statement_timeout or 0.0
    found = holders(conn, tables, seconds) if tables else []
    if not found:
        return StatementTimedOut(
            f"PostgreSQL gave up waiting for a lock while {what} after {seconds:g} s; "
            "what held it is gone now",
            "try again; if this repeats, look for long transactions on the outbox's "
            "tables (pg_stat_activity, pg_locks) or raise --lock-timeout",
        )
    held = "; ".join(found[:NAMED_HOLDERS])
    if len(found) > NAMED_HOLDERS:
        held += f"; and {len(found) - NAMED_HOLDERS} more"
    return StatementTimedOut(
        f"PostgreSQL gave up waiting for a lock while {what} after {seconds:g} s: held by {held}",
        "settle that, then try again, or raise --lock-timeout",
    )


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


Refusal = Callable[[str, psycopg.Error], OutboxError]


@contextlib.contextmanager
def translated(
    conn: psycopg.Connection[Any],
    what: str,
    *,
    hints: Hints = RELAY_HINTS,
    statement_timeout: float | None = None,
    lock_timeout: float | None = None,
    tables: Sequence[str] = (),
    refused: Refusal | None = None,
) -> Iterator[None]:
    """The one translation of driver errors, for every store: a psycopg error raised
    inside becomes an ``outbox.errors`` type, saying ``what`` was being done, after
    ending any transaction the error left open on a live session.

    ``DatabaseUnavailable`` when the session is gone or the server failed on it
    (``StatementTimedOut`` for a cancelled statement); a statement the server
    refused becomes ``refused(what, exc)`` if given, else ``MissingPrivileges`` or
    ``DatabaseRefused``.  ``hints`` say how to go on: a daemon's or an operator's.
    """
    try:
        yield
    except OutboxError:
        raise
    except psycopg.Error as exc:
        if isinstance(exc, StandbyWait):
            raise CommitAwaitsStandby(
                f"gave up waiting while {what}: {first_line(exc)}", hint_for(exc)
            ) from exc
        if isinstance(exc, ServerSilent):
            raise DatabaseUnavailable(
                f"PostgreSQL did not answer while {what}: {first_line(exc)}", hint_for(exc)
            ) from exc
        if session_lost(conn, exc):
            raise DatabaseUnavailable(
                f"lost the PostgreSQL connection while {what}: {first_line(exc)}",
                hints.lost,
            ) from exc
        if conn.info.transaction_status != pq.TransactionStatus.IDLE:
            # The session lives: end any open transaction so the retry starts clean.
            with contextlib.suppress(psycopg.Error):
                conn.execute("ROLLBACK")
        if isinstance(exc, pgerrors.QueryCanceled | pgerrors.LockNotAvailable):
            raise timed_out(
                conn,
                exc,
                what,
                tables,
                statement_timeout=statement_timeout,
                lock_timeout=lock_timeout,
                retries=hints.retries,
            ) from exc
        if isinstance(exc, psycopg.OperationalError):
            # Transient trouble on a live session (resources, a lock timeout).
            raise DatabaseUnavailable(
                f"PostgreSQL failed while {what}: {first_line(exc)}",
                hints.failed,
            ) from exc
        if refused is not None:
            raise refused(what, exc) from exc
        if isinstance(exc, pgerrors.InsufficientPrivilege):
            raise MissingPrivileges(
                f"PostgreSQL refused {what}: {first_line(exc)}",
                "grant the privileges listed in docs/reference/privileges.md",
            ) from exc
        # A constraint, a trigger, a value the server cannot store: a known
        # condition too, never a traceback (and the relay retries it).
        raise DatabaseRefused(
            f"PostgreSQL refused {what}: {first_line(exc)}", hints.refused
        ) from exc


class Session:
    hints = RELAY_HINTS  # how its errors' hints say to go on

    def __init__(
        self,
        dsn: str,
        table: str,
        application_name: str,
        connect_timeout: float,
        statement_timeout: float | None = None,
        lock_timeout: float | None = None,
        client_deadline: bool = False,
    ):
        self.table = table
        self.queries = Queries(table)
        self.statement_timeout = statement_timeout
        self.lock_timeout = lock_timeout
        self.conn = connect(
            dsn,
            application_name=application_name,
            connect_timeout=connect_timeout,
            statement_timeout=statement_timeout,
            lock_timeout=lock_timeout,
            client_deadline=client_deadline,
        )

    @contextlib.contextmanager
    def _translated(self, what: str) -> Iterator[None]:
        with translated(
            self.conn,
            what,
            hints=self.hints,
            statement_timeout=self.statement_timeout,
            lock_timeout=self.lock_timeout,
            tables=[self.table, f"{self.table}_dead_letters", f"{self.table}_relays"],
        ):
            yield

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
