"""The relay's batch store (``BatchStore``): its work connection.

It claims rows, prepares and finishes batches, records a batch's dead letters,
and answers what the resolver, ``outbox status``, the metrics and the console's
charts ask about batches, relays and the backlog.
It runs in autocommit mode and issues BEGIN / PREPARE TRANSACTION / COMMIT
PREPARED itself, so that a prepared batch never pins the connection's transaction
state.  The relay's other sessions (control, wake-up) are in ``relays``.

Driver exceptions never leave ``outbox.db`` (``session.Session.translated``). A lost
connection during PREPARE or COMMIT/ROLLBACK PREPARED raises ``OutcomeUnknown``:
the caller must look the gid up after reconnecting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import re
import time
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import errors as pgerrors
from psycopg import pq, sql
from psycopg.types.json import Jsonb
from psycopg.types.numeric import Int8

from outbox import gid as gids
from outbox.db import migrate, privileges
from outbox.db.front import (
    RESCAN_SECONDS,
    RESCAN_SLICES,
    SAVE_SECONDS,
    ClaimFront,
    Cluster,
    NetState,
    RescanPass,
    SavedFront,
    SliceRead,
    begun,
    next_pass_in,
    recorded,
    resumed,
    tid,
)
from outbox.db.replication import Replication
from outbox.db.rows import claim_cursor, claimed_rows
from outbox.db.session import Session, first_line, session_lost
from outbox.errors import (
    DatabaseRefused,
    DatabaseUnavailable,
    DeadLettersUnwritable,
    GidHeld,
    MissingPrivileges,
    OutboxError,
    OutcomeUnknown,
    PreparedSlotsExhausted,
    PreparedTransactionsDisabled,
)
from outbox.message import DeadLetter, OutboxRow

Row = dict[str, Any]
Conn = psycopg.Connection[Row]

# What a server with prepared transactions disabled needs (the relay's preflight, and
# ``outbox status``, which says it for each database it looks at).
PREPARED_DISABLED = "PostgreSQL has prepared transactions disabled (max_prepared_transactions = 0)"
PREPARED_DISABLED_HINT = (
    "set max_prepared_transactions to at least twice the number of relays "
    "(e.g. 64) in postgresql.conf and restart PostgreSQL"
)

# How many keyed rows, in batches, a claim looks at from the front of the outbox to
# find the keys it may take (``queries.sql``, ``claim_batch``).  Rows of keys held by
# other batches count too: a key with a larger backlog than this delays the keys
# behind it until it drains (docs/explanation/ordering.md).
KEYED_WINDOW = 5

# The claim's plan must not depend on the statistics (``queries.sql``,
# ``claim_batch``): a table analyzed while nearly empty made the planner read the
# whole table, in a sequential scan and a sort, to find the front of the keyed rows.
# And it is planned once per session: planning the claim took three times as long
# as running it on a small batch (0.36 ms against 0.12 ms), so at 2,000 commits/s,
# a few rows per batch, the server spent more on planning claims than on claiming.
# The driver prepares the claim on its 5th run; the generic plan is then reused
# (``tests/integration/db/test_claim_plan.py`` pins its shape too).  Sent with the
# claim and its BEGIN in one round trip; both settings end with the transaction.
# (Two round trips, BEGIN and the settings as one simple query and then the claim,
# saved the relay about 0.05 ms of CPU per claim but cost its backend about as much
# more: no gain.)
#
# And never JIT-compiled.  The generic plan's cost is a guess (its LIMITs are
# parameters, the tails' join is estimated at millions of rows) that grows with the
# table's size on disk: on a never-vacuumed table (relpages 0, reltuples -1: the
# planner counts the pages times a density guessed from the column types) that a
# few bursts had grown to 31,000 pages, a claim of 100 rows cost 560,000, above
# jit_above_cost and jit_inline/optimize_above_cost (100,000 and 500,000 by
# default), and every execution spent 0.5-0.9 s of CPU in LLVM (inlining,
# optimization, emission of 106 functions) to then run for 1.5 ms: 380 msg/s
# instead of 12,000 at 100 rows per batch, until autovacuum's first visit.  JIT
# only pays on long scans; the claim reads a few hundred index entries.
#
# And no bitmap scan: the generic plan does not know the low-water mark W
# (``outbox.db.front``), guesses that a third of the keyed rows are at or after
# it, and then preferred a bitmap scan of all of them and a sort to the index scan
# in id order that stops after the window (3,003 rows read for a window of 500).
# Every other scan of the claim is a lookup by id or txid, which a plain index
# scan does as well.
PINNED_CLAIM_PLAN = (
    "SELECT set_config('enable_seqscan', 'off', true),"
    " set_config('enable_bitmapscan', 'off', true),"
    " set_config('plan_cache_mode', 'force_generic_plan', true),"
    " set_config('jit', 'off', true)"
)

# A gid of the relay's own format (``outbox.gid``) needs no escaping: the statements
# that name it are built as bytes, not composed (composition showed in the relay's
# profile at a few rows per batch).  Anything else is quoted by the driver.
_PLAIN_GID = re.compile(r"[A-Za-z0-9_:.-]+")


def gid_statement(verb: str, gid: str) -> bytes | sql.Composed:
    """``verb`` followed by ``gid`` as a string literal."""
    if _PLAIN_GID.fullmatch(gid):
        return f"{verb} '{gid}'".encode()
    return sql.SQL(verb + " {}").format(sql.Literal(gid))


@dataclasses.dataclass(frozen=True)
class PreparedBatch:
    """A row of ``pg_prepared_xacts``."""

    gid: str
    prepared: datetime.datetime
    owner: str
    local: bool  # in the current database
    age_seconds: float


@dataclasses.dataclass(frozen=True)
class Backend:
    """A server process of one of our sessions, told apart from a later process
    that reused its pid by when it started."""

    pid: int
    started: datetime.datetime
    application_name: str


@dataclasses.dataclass(frozen=True)
class RelayLiveness:
    relay_id: str
    lock_held: bool
    heartbeat_age: float | None  # None: the relay never registered or was forgotten
    backend_pid: int | None
    # Its last heartbeat predates this server's start or promotion: seconds since
    # then (its session ended with the server; the relay may take its id back).
    server_age: float | None = None


def dead_letter_params(letter: DeadLetter, gid: str) -> dict[str, Any]:
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


def net_state(row: Row) -> NetState:
    """The safety net's schedule in a row of ``saved_front`` or ``locked_front``."""
    return NetState(
        pass_end=row["pass_end"],
        pass_at=row["pass_at"] or 0,
        pass_began=row["pass_began"],
        pass_found=row["pass_found"] or 0,
        pass_age=row["pass_age"],
        last_pass_at=row["last_pass_at"],
        last_pass_found=row["last_pass_found"],
        last_pass_age=row["last_pass_age"],
    )


def net_params(net: NetState) -> dict[str, Any]:
    return {
        "pass_end": None if net.pass_end is None else Int8(net.pass_end),
        "pass_at": Int8(net.pass_at),
        "pass_began": net.pass_began,
        "pass_found": Int8(net.pass_found),
        "last_pass_at": net.last_pass_at,
        "last_pass_found": None if net.last_pass_found is None else Int8(net.last_pass_found),
    }


def chosen_front(
    saved: ClaimFront | None, saved_xmax: int | None, session: ClaimFront
) -> ClaimFront | None:
    """The front to save: the session's if it is fresher than the one saved on this
    cluster, timeline and file (``saved``, None: none, or saved elsewhere), else the
    one saved (which keeps its row: the session's late ids join it); None: neither
    is a front to save."""
    usable = session.low_water is not None and session.seen is not None
    if saved is None:
        return session if usable else None
    if not usable or saved_xmax is None:
        return saved
    return session if snapshot_xmax(session.seen) > saved_xmax else saved


def snapshot_xmax(snapshot: str | None) -> int:
    """The xmax of a ``pg_snapshot`` in its text form (``xmin:xmax:xip,…``)."""
    return int(snapshot.split(":")[1]) if snapshot else 0


class BatchStore(Session):
    """Claims, prepares and finishes batches on the relay's work connection."""

    def __init__(
        self,
        dsn: str,
        table: str,
        *,
        application_name: str = "outbox-relay",
        connect_timeout: float = 10.0,
        statement_timeout: float | None = None,
        lock_timeout: float | None = None,
        note_backend: bool = False,
        client_deadline: bool = False,
        rescan_seconds: float | None = None,
    ) -> None:
        """``rescan_seconds``: how often a pass of the safety net begins, at most
        (``outbox.db.front.RESCAN_SECONDS`` by default).  ``note_backend``: look up
        and keep this session's backend (``backend``), for ending it should the
        connection be lost (the relay's work session); one round
        trip, which ``outbox resolve``, ``status`` and the console do not need.
        ``client_deadline``: see ``outbox.db.session.connect`` (``resolve``, ``status``
        and the console; not the relay)."""
        super().__init__(
            dsn,
            table,
            application_name,
            connect_timeout,
            statement_timeout,
            lock_timeout,
            client_deadline=client_deadline,
        )
        self._claim: tuple[psycopg.Cursor[tuple[Any, ...]], psycopg.Cursor[Any], bytes] | None = (
            None
        )
        self.backend: Backend | None = None
        # Where this session's claims start (``outbox.db.front``): the front the
        # relays saved, if it is this cluster's (read before the first claim,
        # ``_resumed``), else from the bottom; then past what the claims before saw
        # gone.  Saved every ``save_seconds`` (``save_front``).
        self.front = ClaimFront()
        self._resumed = False
        # The outbox table's file this session's claims began on (``saved_front``):
        # its front is not saved for another (``save_front``).
        self._filenode: int | None = None
        self.save_seconds = SAVE_SECONDS
        self._save_at = time.monotonic() + self.save_seconds
        self._saved = ClaimFront()
        # The safety net (``rescan_due``): its schedule as last saved or read
        # (``net``, the table's, shared by every relay), when this session next
        # looks whether a pass is due, the pass under way as far as this session
        # knows, when its next slice is due, and the slices read since the last save.
        self.rescan_seconds = RESCAN_SECONDS if rescan_seconds is None else rescan_seconds
        self.net = NetState()
        self._rescan_at = time.monotonic() + self.rescan_seconds
        self.rescan: RescanPass | None = None
        self._slice_at = 0.0
        self._reads: list[SliceRead] = []
        if not note_backend:
            return
        try:
            with self._translated("connecting"):
                row = self.conn.execute(self.queries["own_backend"]).fetchone()
        except OutboxError:
            self.close()
            raise
        # None only if the server hides our own row of pg_stat_activity.
        if row:
            self.backend = Backend(row["pid"], row["backend_start"], row["application_name"])

    def end_predecessor(self, backend: Backend, wait: float) -> bool:
        """End ``backend``, an earlier session of ours whose connection was lost, and
        wait up to ``wait`` seconds until it is gone; False if it still runs.

        A client that lost its connection does not end its backend: a PREPARE or
        COMMIT PREPARED whose reply never came may still be running (waiting for a
        synchronous standby, or for a disk), and it holds its gid.  Until that
        backend is gone, looking the gid up says nothing: absent may become
        prepared a moment later, present may be committed a moment later.  So the
        relay settles its batches in doubt only after this returned True.
        """
        deadline = time.monotonic() + wait
        params = {
            "pid": backend.pid,
            "started": backend.started,
            "application_name": backend.application_name,
        }
        with self._translated("ending the relay's previous database session"):
            while self.conn.execute(self.queries["end_backend"], params).fetchone():
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.02)
        return True

    # -- preflight ---------------------------------------------------------
    def prepared_slots(self) -> int:
        """The server's ``max_prepared_transactions`` (0: no relay can work here)."""
        with self._translated("checking the database"):
            row = self.conn.execute(self.queries["max_prepared_transactions"]).fetchone()
        return int(row["slots"]) if row else 0

    def check_ready(self) -> None:
        """Raise if prepared transactions are disabled, the schema is not current
        (missing, older, or newer than this code), or the role lacks a privilege
        the relay needs."""
        if self.prepared_slots() <= 0:
            raise PreparedTransactionsDisabled(PREPARED_DISABLED, PREPARED_DISABLED_HINT)
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

        Binary results (``claim_cursor``): each payload is a view of the driver's
        result, held once; the result is freed when the batch's rows are dropped.

        The claim starts at ``front`` and returns the next one (``outbox.db.front``:
        the low-water mark, the late rows, the snapshot), which replaces it, so a
        claim reads the rows deleted since the claim before it, not every dead row
        the held horizon keeps.  A claim that fails leaves the front as it was
        (an older front is always a valid one: it only costs a longer walk).

        Crash right after: the open transaction dies with the session, the rows are
        free again at once; nothing to clean up.
        """
        if not self._resumed:
            self.front = self.saved_front(resuming=True)
            self._resumed = True
        elif self.rescan is None and time.monotonic() >= self._rescan_at:
            self.save_front(begin_pass=True)
        elif self._reads or time.monotonic() >= self._save_at:
            self.save_front()
        sliced = self.rescan is not None and time.monotonic() >= self._slice_at
        params = self.claim_params(limit, max_bytes, hold_keys=hold_keys, own=own, sliced=sliced)
        with self._translated("claiming a batch"):
            cur, plain, statement = self._claim_statement()
            if psycopg.Pipeline.is_supported():
                # BEGIN, the planner settings and the claim in one round trip.
                with self.conn.pipeline():
                    plain.execute(b"BEGIN", prepare=False)
                    plain.execute(PINNED_CLAIM_PLAN)
                    cur.execute(statement, params)
            else:  # a libpq older than 14: two round trips
                plain.execute(f"BEGIN; {PINNED_CLAIM_PLAN}")
                cur.execute(statement, params)
            rows, front = claimed_rows(self.conn, cur)
        if front is not None:
            low_water, late, seen, found = front
            self.front = self.front.after(low_water, late, seen)
            if sliced and self.rescan is not None and self.net.pass_began is not None:
                # Saved, with the front that holds what it found, before the next
                # claim (``save_front``): only then does the pass count it read.
                first, last = self.rescan.slice()
                self._reads.append(SliceRead(self.net.pass_began, first, last, found or 0))
                self.rescan = self.rescan.after()
                self._slice_at = time.monotonic() + self.rescan_seconds / (2 * RESCAN_SLICES)
        return rows

    def heap_pages(self) -> int:
        """The outbox's heap pages now: what a pass of the safety net reads."""
        with self._translated("reading the outbox's size"):
            row = self.conn.execute(self.queries["heap_pages"], {"table": self.table}).fetchone()
        assert row is not None
        return int(row["pages"])

    @property
    def idle(self) -> bool:
        """Connected, and no transaction open (no claim before its PREPARE)."""
        return not self.broken and self.conn.info.transaction_status == pq.TransactionStatus.IDLE

    def saved_front(self, *, resuming: bool = False) -> ClaimFront:
        """The front a new session starts from (``outbox.db.front.resumed``): the one
        the relays saved if it is this cluster's and timeline's, else the bottom.
        ``resuming``: this session's claims start from it, on the outbox's file now."""
        with self._translated("reading the saved claim front"):
            row = self.conn.execute(self.queries["saved_front"], {"table": self.table}).fetchone()
        assert row is not None
        if resuming:
            self._filenode = row["here_filenode"]
        here = Cluster(
            row["here_system_identifier"],
            row["here_timeline"],
            row["here_filenode"],
            row["here_xmax"],
        )
        if row["seen"] is not None:
            # The schedule of the safety net belongs to the file it read.
            place = (row["system_identifier"], row["timeline"], row["filenode"])
            here_place = (here.system_identifier, here.timeline, here.filenode)
            self.net = net_state(row) if place == here_place else NetState()
        if resuming:
            self._schedule(self.net if row["seen"] is not None else None)
        saved = None
        if row["seen"] is not None:
            saved = SavedFront(
                ClaimFront(row["low_water"], tuple(row["late"]), row["seen"]),
                Cluster(
                    row["system_identifier"], row["timeline"], row["filenode"], row["seen_xmax"]
                ),
            )
        return resumed(saved, here)

    def save_front(self, *, begin_pass: bool = False) -> None:
        """Save this session's front and the slices of the safety net it read since
        (``outbox.db.front``), and with ``begin_pass`` begin a pass if one is due;
        then follow the schedule saved (``net``): another relay's pass, or its
        slices.  In a transaction of its own that locks the saved row, outside any
        claim (autocommit).  The front saved is the fresher of this session's and
        the one saved (by the xmax of its snapshot), with the late ids of both: a
        slice's finds stay saved whichever relay saves next.

        Crash right after: saved, or not at all (the slices are then read again)."""
        self._save_at = time.monotonic() + self.save_seconds
        front, reads = self.front, tuple(self._reads)
        if front == self._saved and not reads and not begin_pass:
            return
        with self._translated("saving the claim front"), self.conn.transaction():
            self.conn.execute(PINNED_CLAIM_PLAN)
            params = {"table": self.table}
            row = self.conn.execute(self.queries["locked_front"], params).fetchone()
            if row is None:
                row = self.conn.execute(self.queries["here"], params).fetchone()
                assert row is not None
            if row["here_filenode"] != self._filenode:
                # The outbox was rewritten (truncated and reloaded, restored, VACUUM
                # FULL) since this session's claims began: its rows may hold txids
                # from elsewhere, below W.  Walk from the bottom once, as a new
                # session would, and save nothing for a file it did not begin on.
                self.front, self._saved = ClaimFront(), ClaimFront()
                self._filenode = row["here_filenode"]
                self._reads.clear()
                self.rescan = None
                self._rescan_at = time.monotonic()
                return
            place = (row["here_system_identifier"], row["here_timeline"], row["here_filenode"])
            same = row.get("seen") is not None and place == (
                row["system_identifier"],
                row["timeline"],
                row["filenode"],
            )
            net = recorded(net_state(row), reads) if same else NetState()
            if begin_pass:
                net = begun(net, self.rescan_seconds, row["pages"], row["now"])
            saved = ClaimFront(row["low_water"], tuple(row["late"]), row["seen"]) if same else None
            chosen = chosen_front(saved, row.get("seen_xmax"), front)
            if chosen is not None:
                self.conn.execute(
                    self.queries["write_front"],
                    {
                        **chosen.params(),
                        "late": sorted({*chosen.late, *front.late, *(saved.late if saved else ())}),
                        "system_identifier": row["here_system_identifier"],
                        "timeline": row["here_timeline"],
                        "filenode": Int8(row["here_filenode"]),
                        **net_params(net),
                    },
                )
            else:
                net = NetState() if not same else net_state(row)
        self._saved = front
        self._reads.clear()
        self._schedule(net if chosen is not None or same else None)

    def _schedule(self, net: NetState | None) -> None:
        """Follow the safety net's schedule as saved (None: no front is saved: look
        again in ``rescan_seconds``)."""
        now = time.monotonic()
        if net is None:
            self.net, self.rescan = NetState(), None
            self._rescan_at = now + self.rescan_seconds
            return
        self.net = net
        under_way = net.rescan()
        if under_way is None:
            self.rescan = None
            self._rescan_at = now + next_pass_in(net, self.rescan_seconds)
        elif self.rescan is None or (self.rescan.end, self.rescan.at) != (
            under_way.end,
            under_way.at,
        ):
            self.rescan = under_way
            self._slice_at = min(self._slice_at, now)

    def claim_params(
        self,
        limit: int,
        max_bytes: int = 2**62,
        *,
        hold_keys: bool = True,
        own: Sequence[int] = (),
        sliced: bool = False,
    ) -> dict[str, Any]:
        """The parameters of the next claim (``claim_batch``), from this session's front
        (and with ``sliced``, the next slice of the safety net's pass under way)."""
        first, last = self.rescan.slice() if sliced and self.rescan is not None else (0, 0)
        return {
            "slice_from": tid(first),
            "slice_to": tid(last),
            "limit": limit,
            "window": limit * KEYED_WINDOW,
            "max_bytes": max_bytes,
            "hold": hold_keys,
            "own": list(own),
            **self.front.params(),
        }

    def _claim_statement(
        self,
    ) -> tuple[psycopg.Cursor[tuple[Any, ...]], psycopg.Cursor[Any], bytes]:
        """The claim's cursor, a cursor for the statements before it (BEGIN, the
        planner settings), and the claim's statement, built once per session:
        composing the statement and setting up a cursor's loaders for every claim was
        about 7% of the relay's CPU at a few rows per batch, and a cursor per
        statement (``Connection.execute``) a few more.  Reusing the claim's cursor
        keeps the rows of the batch before valid: each payload's view holds its own
        result."""
        if self._claim is None:
            self._claim = (
                claim_cursor(self.conn),
                self.conn.cursor(),
                self.queries["claim_batch"].as_bytes(self.conn),
            )
        return self._claim

    def abandon_claim(self) -> None:
        """Roll back an unprepared claim (nothing claimed, or before PREPARE)."""
        with self._translated("rolling back a claim"):
            self.conn.execute(b"ROLLBACK", prepare=False)

    def prepare(self, gid: str) -> None:
        """PREPARE TRANSACTION: the claim survives any crash, undecided.

        Raises ``OutcomeUnknown`` if the connection drops, because PREPARE may or
        may not have happened; the caller must not publish and must look the gid
        up (``gid_exists``) after reconnecting.
        """
        try:
            self.conn.execute(gid_statement("PREPARE TRANSACTION", gid), prepare=False)
        except pgerrors.ObjectNotInPrerequisiteState as exc:
            self._rollback_quietly()
            raise PreparedTransactionsDisabled(
                "PostgreSQL refused PREPARE TRANSACTION: prepared transactions are disabled",
                "set max_prepared_transactions > 0 and restart PostgreSQL",
            ) from exc
        except psycopg.Error as exc:
            if session_lost(self.conn, exc) or isinstance(exc, pgerrors.QueryCanceled):
                self._rollback_quietly()  # a failed PREPARE has ended the transaction
                raise OutcomeUnknown(f"PREPARE of {gid} was cut off: {first_line(exc)}") from exc
            self._rollback_quietly()
            if "maximum number of prepared transactions" in str(exc):
                raise PreparedSlotsExhausted(
                    "every prepared-transaction slot of the server is in use",
                    "raise max_prepared_transactions or run fewer relays; "
                    "the relay backs off and retries",
                ) from exc
            raise DatabaseUnavailable(f"PREPARE TRANSACTION failed: {first_line(exc)}") from exc

    def _rollback_quietly(self) -> None:
        with contextlib.suppress(psycopg.Error):
            self.conn.execute("ROLLBACK")

    def finish(self, gid: str, *, commit: bool) -> bool:
        """COMMIT PREPARED or ROLLBACK PREPARED; False if the gid was finished elsewhere.

        Two finishers may race on one gid: the loser sees 42704 (no such gid: it
        was finished) or 55000 (busy: another session is preparing or finishing it
        right now).  Busy raises ``GidHeld`` (an ``OutcomeUnknown``): that session may yet fail, or
        be our own cut-off session still running, so the gid is looked up again
        later rather than taken as finished.  A dropped connection raises
        ``OutcomeUnknown`` too.
        """
        verb = "COMMIT PREPARED" if commit else "ROLLBACK PREPARED"
        try:
            self.conn.execute(gid_statement(verb, gid), prepare=False)
        except pgerrors.UndefinedObject:
            return False
        except pgerrors.ObjectNotInPrerequisiteState as exc:
            raise GidHeld(f"{verb} of {gid}: another session holds it ({first_line(exc)})") from exc
        except psycopg.Error as exc:
            # A statement timeout (or an operator's pg_cancel_backend) may strike
            # before or after the server finished: look the gid up, like a cut.
            if session_lost(self.conn, exc) or isinstance(exc, pgerrors.QueryCanceled):
                raise OutcomeUnknown(f"{verb} of {gid} was cut off: {first_line(exc)}") from exc
            # Refused on a live session (e.g. another role's gid): still prepared.
            raise DatabaseRefused(
                f"PostgreSQL refused {verb} {gid}: {first_line(exc)}",
                "the batch stays prepared; the relay retries with backoff",
            ) from exc
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

        Any failure but a lost session raises ``DeadLettersUnwritable``, whatever
        the server said (a revoked INSERT, a lock held past ``lock_timeout``, a
        constraint or trigger someone added): the caller then writes the batch's
        dead letters before publishing anything of it (``relay.batches``).
        """
        params = [dead_letter_params(d, gid) for d in dead]
        try:
            with self._translated("recording dead letters"), self.conn.transaction():
                self.conn.cursor().executemany(self.queries["record_dead_letters"], params)
        except MissingPrivileges as exc:
            exact = self._missing(privileges.DEAD_LETTERS_WRITE, "recording dead letters") or exc
            raise DeadLettersUnwritable(exact.message, exact.hint) from exc
        except OutboxError as exc:
            if self.broken:
                raise
            said = first_line(exc.__cause__) if exc.__cause__ is not None else exc.message
            raise DeadLettersUnwritable(
                f"PostgreSQL refused to record dead letters: {said}",
                "nothing more is published until they can be written; the relay "
                "retries with backoff",
            ) from exc

    def rescan_due(self) -> bool:
        """Whether the next claim may begin a pass of the safety net or reads its
        next slice (``outbox.db.front.RescanPass``: a pass every ``rescan_seconds``
        counted from when the last one began, whichever relay ran it, a slice every
        ``rescan_seconds / (2 * RESCAN_SLICES)``; a row whose txid is not its
        writer's is found within that time).  An idle relay claims once
        when it is due (``Relay._wait_for_work``): its polls look only where its
        claims do."""
        if self.rescan is None:
            return time.monotonic() >= self._rescan_at
        return time.monotonic() >= self._slice_at

    def has_claimable_rows(self) -> bool:
        """Whether any row nobody holds is where the claim looks (``front``)."""
        with self._translated("looking for claimable rows"), self.conn.transaction():
            row = self.conn.execute(
                self.queries["has_claimable_rows"], self.front.params()
            ).fetchone()
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
                server_age=r["server_age"],
            )
            for r in rows
        }

    def take_handover(self, relay_id: str) -> bool:
        """Take the hand-over lock of ``relay_id`` on this session (``outbox.gid``);
        False if someone holds it: the relay taking its id back, or another
        resolver finishing its batches.  A resolver holds it from before it looks
        at the relay's liveness and the ledger until its batches are finished."""
        params = {"lock_class": gids.HANDOVER_LOCK_CLASS, "lock_key": gids.lock_key(relay_id)}
        with self._translated("taking a relay id's hand-over lock"):
            row = self.conn.execute(self.queries["try_lock_relay"], params).fetchone()
            return bool(row and row["locked"])

    def release_handover(self, relay_id: str) -> None:
        params = {"lock_class": gids.HANDOVER_LOCK_CLASS, "lock_key": gids.lock_key(relay_id)}
        with self._translated("releasing a relay id's hand-over lock"):
            self.conn.execute(self.queries["unlock_relay"], params)

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
        """Rows in the outbox and the oldest one's age, counted where the relays'
        claims look (``queries.sql``, ``front_rows``: from the front they saved)."""
        return self._from_front("backlog", "measuring the backlog")

    def exact_backlog(self) -> Row:
        """Every row in the outbox and the oldest one's age, by reading the whole table
        (``outbox status --exact``): also the rows ``backlog`` cannot see (behind the
        claim front, with a txid that is not their writer's), and every dead row a
        held horizon keeps."""
        with self._translated("counting every row of the outbox"):
            row = self.conn.execute(self.queries["exact_backlog"]).fetchone()
            assert row is not None
            return row

    def _from_front(self, query: str, what: str, **params: Any) -> Row:
        """One row of ``query``, a statement over ``front_rows``, from the saved front
        (none: from the bottom), with the claim's planner settings: the plan must
        read the indexes from W, never the table (``PINNED_CLAIM_PLAN``)."""
        front = self.saved_front()
        with self._translated(what), self.conn.transaction():
            self.conn.execute(PINNED_CLAIM_PLAN)
            row = self.conn.execute(self.queries[query], {**front.params(), **params}).fetchone()
            assert row is not None
            return row

    def dead_letter_summary(self) -> tuple[int, int]:
        """Dead letters, and how many ordering keys they belong to."""
        with self._translated("counting dead letters"):
            row = self.conn.execute(self.queries["dead_letter_count"]).fetchone()
            return (int(row["dead_letters"]), int(row["ordering_keys"])) if row else (0, 0)

    def scheduled_summary(self) -> Row:
        """Scheduled rows (schema 0009): how many, seconds until the next is due (None:
        none), seconds the oldest due one has waited to be moved (0: none)."""
        with self._translated("reading the scheduled rows"):
            row = self.conn.execute(self.queries["scheduled_status"]).fetchone()
        assert row is not None
        return row

    def metrics_snapshot(self) -> Row:
        """Backlog (as ``backlog``), prepared batches, dead letters and live relays, in
        one round trip after reading the saved front."""
        return self._from_front(
            "metrics_snapshot",
            "reading metrics",
            gid_prefix=gids.relay_prefix(self.table),
            lock_class=gids.LOCK_CLASS,
        )

    def chart_sample(self) -> Row:
        """What the console's charts sample, in one round trip after reading the saved
        front: ``backlog`` and ``oldest_seconds`` (as ``backlog``), the counters
        ``deleted`` (rows ever deleted from the outbox) and ``dead_lettered`` (rows
        ever inserted into the dead letters), ``dead_rows`` (the outbox's) and
        ``horizon_seconds`` (how long the horizon has been held)."""
        return self._from_front(
            "chart_sample",
            "sampling the outbox",
            outbox=self.table,
            dead_letters=f"{self.table}_dead_letters",
        )
