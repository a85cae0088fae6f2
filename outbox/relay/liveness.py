"""The relay's proof of life, kept by a thread of its own.

A relay is *dead* when its control session is gone (the advisory lock goes with
it) and *presumed partitioned* when its heartbeat is older than ``relay_timeout``.
Neither may ever be caused by the relay's own slow statement: written from the
batch loop, one claim slower than ``relay_timeout`` made the relay's heartbeat
stale, so it rolled back its own published batches and every other relay's
resolver rolled back its batches as "presumed partitioned" and ended its session
(2,000 to 5,000 duplicates with no fault at all).  So the heartbeat has its own
thread and its own session, and nothing else runs on that session.

What can still make the heartbeat stale is what should: the control session
cannot reach PostgreSQL (a partition, a server that hangs), or the server cannot
run the heartbeat within ``statement_timeout``.  The batch loop reads ``age`` and
stops committing before a resolver may presume it dead (``Relay._may_commit``).

After the relay's work session was lost, the control session may be lost with it
(a server restart or a failover ends every session), and the heartbeat thread
would only find out at its next beat, up to ``interval`` later: batches published
meanwhile under the dead relay id are rolled back, a second round of duplicates
for one outage.  So the relay asks for a beat at once (``probe``), on this thread,
before it claims again.

A lost control session is not a dead relay when the process lives: after a
database restart or a failover the relay still holds its batches (prepared
transactions survive both) and knows which of them the broker confirmed.  So it
takes its own relay id back (``resume``) instead of drawing a new one, and
finishes them itself (``outbox.relay.batches``, "the hand-over"); a resolver
waits for it (``resolver/decide.py``: "reconnecting") and never acts on the id
while the relay is taking it back (``outbox.gid.HANDOVER_LOCK_CLASS``).
"""

from __future__ import annotations

import logging
import threading
import time

from outbox import events
from outbox.db.relays import ControlSession
from outbox.errors import DatabaseUnavailable
from outbox.events import emit
from outbox.gid import new_relay_id

log = logging.getLogger("outbox.relay")


class Liveness:
    """Holds the relay's advisory lock and writes its heartbeat every ``interval``.

    ``start`` registers a new relay id (its lock proves the relay alive); ``lost``
    turns true once the control session is gone, after which the relay id is dead
    for good and the relay must start a new ``Liveness`` (resolvers may already be
    finishing the old id's batches).
    """

    def __init__(self, control: ControlSession, interval: float) -> None:
        self.control = control
        self.relay_id = control.relay_id
        self.interval = interval
        self.last_ok = time.monotonic()  # when the last heartbeat committed
        self._lost = threading.Event()
        self._stopping = threading.Event()
        self._beat_now = threading.Event()  # ``probe``: beat before ``interval`` is up
        self._beaten = threading.Event()  # a beat was tried since ``probe`` asked
        # The starting thread's event fields (a fleet's ``database``): the heartbeat's
        # events name the database too.
        self._context = events.current_context()
        self._thread = threading.Thread(
            target=self._run, name=f"outbox-heartbeat-{self.relay_id[:8]}", daemon=True
        )

    @classmethod
    def start(
        cls,
        dsn: str,
        table: str,
        *,
        interval: float,
        connect_timeout: float,
        statement_timeout: float,
    ) -> Liveness:
        """Register a fresh relay id, take its lock and start beating."""
        while True:
            relay_id = new_relay_id()
            control = ControlSession(
                dsn,
                table,
                relay_id,
                connect_timeout=connect_timeout,
                statement_timeout=statement_timeout,
            )
            try:
                if control.acquire():
                    break
            except BaseException:
                control.close()
                raise
            # The key is taken (a 32-bit hash of another relay's id): draw again.
            control.close()
        liveness = cls(control, interval)
        liveness._thread.start()
        return liveness

    @classmethod
    def resume(
        cls,
        relay_id: str,
        dsn: str,
        table: str,
        *,
        interval: float,
        connect_timeout: float,
        statement_timeout: float,
    ) -> Liveness | None:
        """Take ``relay_id`` back after its control session was lost, and beat for it
        again; None if it cannot be taken now (``ControlSession.reclaim``: a resolver
        is finishing its batches, or a session of ours still holds its lock)."""
        control = ControlSession(
            dsn,
            table,
            relay_id,
            connect_timeout=connect_timeout,
            statement_timeout=statement_timeout,
        )
        try:
            if not control.reclaim():
                control.close()
                return None
        except BaseException:
            control.close()
            raise
        liveness = cls(control, interval)
        liveness._thread.start()
        return liveness

    @property
    def lost(self) -> bool:
        return self._lost.is_set() or self.control.broken

    @property
    def age(self) -> float:
        """Seconds since the last heartbeat committed."""
        return time.monotonic() - self.last_ok

    def probe(self, timeout: float) -> None:
        """Beat now and wait for it, up to ``timeout``: a control session found gone
        turns ``lost`` before the relay claims again (the module docstring).  A
        beat that does not answer in time changes nothing here: the heartbeat's
        age tells the batch loop, as it does without a probe."""
        if self.lost or not self._thread.is_alive():
            return
        self._beaten.clear()
        self._beat_now.set()
        self._beaten.wait(timeout)

    def _run(self) -> None:
        with events.context(**self._context):
            self._beat()

    def _beat(self) -> None:
        while True:
            self._beat_now.wait(self.interval)
            self._beat_now.clear()
            if self._stopping.is_set():
                return
            try:
                self.control.heartbeat()
            except DatabaseUnavailable as exc:
                if self.control.broken:
                    self._lost.set()
                    self._beaten.set()
                    emit(log, "relay.control_session_lost", logging.WARNING, error=exc.message)
                    return
                # A live session whose heartbeat failed (statement timeout, a lock
                # held on our registry row): the age grows, which is the truth.
                emit(log, "relay.heartbeat_failed", logging.WARNING, error=exc.message)
                self._beaten.set()
                continue
            self.last_ok = time.monotonic()
            self._beaten.set()

    def stop(self, *, unregister: bool) -> None:
        """Stop beating; with ``unregister``, remove the registry row (clean exit)."""
        self._stopping.set()
        self._beat_now.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 5)
        if unregister and not self.control.broken:
            try:
                self.control.unregister()
            except DatabaseUnavailable as exc:
                emit(log, "relay.unregister_failed", logging.WARNING, error=exc.message)
        self.control.close()
