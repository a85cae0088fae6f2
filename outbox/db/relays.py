"""The relay registry and its sessions: the control session that holds a relay's
advisory lock and heartbeat (proof of life), and the wake-up listener.

Neither ever takes part in a batch: a transaction that ran LISTEN cannot be
prepared.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Any

import psycopg
from psycopg import sql

from outbox import gid as gids
from outbox.db import scheduled
from outbox.db.batches import Backend
from outbox.db.front import ClaimFront
from outbox.db.session import Session

Row = dict[str, Any]
Conn = psycopg.Connection[Row]


class ControlSession(Session):
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
        # This session's backend, for ending it should the connection be lost while
        # the server keeps it (and the relay's lock) alive: ``reclaim`` needs the lock.
        self.backend: Backend | None = None

    def acquire(self) -> bool:
        """Take the relay's advisory lock and register; False if the key is taken."""
        with self._translated("registering the relay"):
            if not self._try_lock(gids.LOCK_CLASS):
                return False
            self._register()
            return True

    def reclaim(self) -> bool:
        """Take this relay id back after its control session was lost (a database
        restart or failover; ``outbox.relay.liveness``); False if it cannot be taken
        now: a resolver is finishing its batches, or a session of ours still holds it.

        Under the hand-over lock (``outbox.gid.HANDOVER_LOCK_CLASS``), which a
        resolver holds for its whole pass over the id's batches: once the relay's
        lock is held again, a resolver that takes the hand-over lock after this
        finds the relay alive and leaves its batches; one that took it before has
        finished with them (and the relay finds their gids gone)."""
        with self._translated("taking the relay id back"):
            if not self._try_lock(gids.HANDOVER_LOCK_CLASS):
                return False
            try:
                if not self._try_lock(gids.LOCK_CLASS):
                    return False
                self._register()
                return True
            finally:
                self.conn.execute(
                    self.queries["unlock_relay"],
                    {
                        "lock_class": gids.HANDOVER_LOCK_CLASS,
                        "lock_key": gids.lock_key(self.relay_id),
                    },
                )

    def _try_lock(self, lock_class: int) -> bool:
        row = self.conn.execute(
            self.queries["try_lock_relay"],
            {"lock_class": lock_class, "lock_key": gids.lock_key(self.relay_id)},
        ).fetchone()
        return bool(row and row["locked"])

    def _register(self) -> None:
        self.conn.execute(
            self.queries["register_relay"],
            {
                "relay_id": self.relay_id,
                "lock_key": gids.lock_key(self.relay_id),
                "hostname": socket.gethostname(),
                "pid": os.getpid(),
            },
        )
        row = self.conn.execute(self.queries["own_backend"]).fetchone()
        if row:
            self.backend = Backend(row["pid"], row["backend_start"], row["application_name"])

    def heartbeat(self) -> None:
        with self._translated("writing the heartbeat"):
            self.conn.execute(self.queries["heartbeat"], {"relay_id": self.relay_id})

    def unregister(self) -> None:
        with self._translated("unregistering the relay"):
            self.conn.execute(self.queries["unregister_relay"], {"relay_id": self.relay_id})


# The first poll after a relay takes the wake-up lock anew (``WakeupListener.poll_pause``).
FIRST_POLL_SECONDS = 0.002


class WakeupListener(Session):
    """LISTENs for the outbox trigger's NOTIFY; the idle relay waits on its socket.

    A session of its own: a transaction that ran LISTEN cannot be prepared, and the
    control session belongs to the heartbeat thread.

    The trigger notifies only while someone holds the wake-up lock
    ``(WAKEUP_LOCK_CLASS, the outbox's oid)`` (schema 0005): a NOTIFY makes its
    transaction hold a database-wide lock from COMMIT until the commit is flushed, so
    commits that notify cannot share a WAL flush.  ``want_wakeups`` takes the lock in
    shared mode (any number of idle relays), ``stop_wanting_wakeups`` lets it go when
    the relay is busy: it claims until the outbox is empty anyway.  The lock is the
    session's, so it goes with the session too.
    """

    def __init__(
        self,
        dsn: str,
        table: str,
        *,
        connect_timeout: float = 10.0,
        statement_timeout: float | None = None,
        lock_timeout: float | None = None,
    ) -> None:
        # Bounded as the work session is: the mover's INSERT into the outbox waits
        # for locks on it (an application's LOCK TABLE, a migration).
        super().__init__(
            dsn,
            table,
            "outbox-relay-wakeup",
            connect_timeout,
            statement_timeout,
            lock_timeout=lock_timeout,
        )
        self.wanting = False  # holds the wake-up lock
        self.wanting_since = 0.0  # when it was taken (time.monotonic)
        with self._translated("subscribing to wake-ups"):
            self.conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.table)))
            # The mover runs here: its INSERT must not wake the relays (schema 0009).
            self.conn.execute("SET outbox.mover = on")
            name = sql.Identifier(self.table).as_string(self.conn)
            row = self.conn.execute(self.queries["outbox_relid"], {"name": name}).fetchone()
        assert row is not None
        self._lock = {"lock_class": gids.WAKEUP_LOCK_CLASS, "relid": row["relid"]}

    def want_wakeups(self, front: ClaimFront | None = None) -> bool:
        """Ask for NOTIFYs (if not held already) and look for rows: True if rows are
        waiting where a claim starting at ``front`` looks (None: anywhere; the
        relay passes its work session's, so the poll does not walk the dead rows
        behind it: ``outbox.db.front``).

        The lock cannot be taken while someone holds it exclusively: an
        application's trigger for a moment (then the next call takes it), or a
        session that kept it; applications notify all the while either way.
        """
        if self.wanting:
            return self.rows_waiting(front)
        params = {**self._lock, **(front or ClaimFront()).params()}
        with self._translated("asking for wake-ups"):
            row = self.conn.execute(self.queries["want_wakeups"], params).fetchone()
        assert row is not None
        self.wanting = bool(row["listening"])
        self.wanting_since = time.monotonic()
        return bool(row["rows_waiting"])

    def poll_pause(self, longest: float) -> float:
        """How long to wait before the next poll: as long as the lock has been held
        (``FIRST_POLL_SECONDS`` at least, ``longest`` at most).  A commit whose
        INSERT ran before the lock was taken notifies nobody; a commit that ends
        ``t`` after the lock was taken is found by about ``2 t``."""
        held = time.monotonic() - self.wanting_since
        return min(max(FIRST_POLL_SECONDS, held), longest)

    def stop_wanting_wakeups(self) -> None:
        try:
            with self._translated("declining wake-ups"):
                self.conn.execute(self.queries["stop_wanting_wakeups"], self._lock)
        finally:
            # Not released on a live session (it refused?): applications notify a
            # little more than needed, nothing worse; the session's end lets it go.
            self.wanting = False

    def fileno(self) -> int:
        return self.conn.fileno()

    def take_notifications(self) -> int:
        """How many wake-ups arrived since the last call (never blocks)."""
        with self._translated("reading wake-ups"):
            return sum(1 for _ in self.conn.notifies(timeout=0))

    def move_due(self, covered: datetime.datetime | None, *, sweep: bool) -> scheduled.Moved:
        """Move the scheduled rows that are due into the outbox (``outbox.db.scheduled``):
        on this session, never the work session's, whose transactions are prepared."""
        with self._translated("moving due scheduled rows"):
            moved = scheduled.move_due(self.conn, self.queries, covered, sweep=sweep)
        return moved

    def dormant_look(self, front: ClaimFront, relay_timeout: float) -> tuple[bool, int]:
        """A dormant relay's look, in one round trip: whether rows wait where a claim
        starting at ``front`` looks, and how many prepared batches of this table no
        live relay answers for (dead, or its heartbeat older than ``relay_timeout``):
        either wakes it (``outbox.relay.process``)."""
        params = {
            **front.params(),
            "gid_prefix": gids.relay_prefix(self.table),
            "lock_class": gids.LOCK_CLASS,
            "relay_timeout": relay_timeout,
        }
        with self._translated("looking for rows and orphaned batches"):
            row = self.conn.execute(self.queries["dormant_look"], params).fetchone()
        assert row is not None
        return bool(row["rows_waiting"]), int(row["batches"])

    def rows_waiting(self, front: ClaimFront | None = None) -> bool:
        """The fallback poll: True if the outbox table has any row where a claim
        starting at ``front`` looks (None: anywhere)."""
        params = (front or ClaimFront()).params()
        with self._translated("polling for rows"):
            row = self.conn.execute(self.queries["rows_waiting"], params).fetchone()
            return row is None or bool(row["rows_waiting"])
