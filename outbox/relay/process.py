"""The relay process: connect, run the batch loop, wait for work, reconnect, stop.

One batch's life (claim → PREPARE → publish → record → COMMIT PREPARED), its
state machine, its crash table and what a failing write costs are in
``outbox/relay/batches.py``; this module is
the process around it, in the spirit of dramatiq's ``Worker``:

- ``serve`` is the whole life, as ``outbox relay`` runs it (``outbox.lifecycle``):
  the endpoints, ``start``, the collector tuned, ``run``, ``close``, the summary;
- ``start`` connects both servers and checks the database (a bad configuration
  fails fast, with a clear message and an exit code);
- ``run`` goes round: reconnect what is broken (ending a lost work session's
  backend, which may still be running a cut-off PREPARE, before anything is
  looked up: ``_end_predecessors``), settle batches in doubt, resolve
  dead relays' batches now and then, move the scheduled rows that came due into
  the outbox (``_move_due``, on the wake-up session; when
  ``outbox.relay.scheduling`` says), take one step of the batches, and when
  a step neither claimed nor committed anything wait for a NOTIFY, the fallback
  poll or the next scheduled row's due time;
- a failure (``batches.RETRYABLE``) is logged (naming the write that failed),
  backed off and retried forever; the backoff grows until a batch is committed
  again, whichever write fails, so a failure that lets a batch be claimed and
  published between two failures still backs off;
- SIGTERM/SIGINT/SIGHUP set the ``StopFlag``: the batch in flight is finished,
  nothing more is claimed, the relay unregisters and exits 0.

Dormancy (``dormant_after`` seconds, 0: never; a fleet's default is 30 s,
``outbox.fleet.process``): a relay that claimed nothing for that long, with no batch
in flight or in doubt, saves its claim front, closes its work session and stops its
liveness (unregisters), and keeps only the wake-up session, and its RabbitMQ
connection (served while it waits, as an idle relay's is).  It wakes on a NOTIFY
(it keeps the wake-up lock), a scheduled row coming due (it moves it), or a look
(``WakeupListener.dormant_look``, one statement: every ``_dormant_poll`` for rows,
every ``resolve_interval`` for orphaned batches) that finds rows, or a prepared
batch of this table that no live relay answers for (a dead relay's batch to
resolve); between them it sleeps on its sockets and its stop
flag's pipe, with no tick; waking is ``_connect_database`` opening what is
missing, as after an outage: a new work session from the saved front, a new relay
id, a resolve pass at once.  One database session per idle database instead of
three: what lets one process serve many databases (``outbox.fleet``).

A crash while going dormant or waking (the line "going dormant or waking" of the
crash table in ``outbox/relay/batches.py``): going dormant, nothing is in flight,
so a crash leaves at most a registry row whose lock died with the process
(forgotten by resolvers) and a front saved or not (a session that finds none walks
from the bottom); waking, it is a relay starting: no batch before its first claim.

Sessions: the work connection (claims, 2PC, resolver passes; every statement
bounded by ``statement_timeout``, and the server checks every 2 s that we are
still there), the control session (advisory lock and heartbeat, on a thread of
its own: ``outbox.relay.liveness``, so a slow statement here cannot make the relay look
partitioned) and the wake-up session (LISTEN, the fallback poll and the mover of
scheduled rows).  "resolver"
is any relay's periodic pass (``resolver.resolve``) or ``outbox resolve``; it acts
only once the owner's control session is gone, or its heartbeat is older than
``relay_timeout`` (partition).  A control session lost while the process lives (a
database restart or failover) is not a dead relay: with batches in flight the
relay takes its relay id back and finishes them (``_register``; the hand-over in
``outbox/relay/batches.py``), and resolvers wait for it.  A relay whose own
heartbeat is that stale no longer writes evidence for its batches: it rolls them
back instead, so a resolver and the relay never disagree about a batch.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from outbox import fault_injection as faults
from outbox import lifecycle
from outbox.amqp import failover
from outbox.amqp.publisher import Publisher
from outbox.config import Settings
from outbox.db import replication
from outbox.db.batches import Backend, BatchStore
from outbox.db.front import ClaimFront
from outbox.db.relays import WakeupListener
from outbox.db.scheduled import MOVE_LIMIT
from outbox.errors import (
    BrokerUnavailable,
    DatabaseUnavailable,
    OutboxError,
    PreparedSlotsExhausted,
)
from outbox.events import emit
from outbox.relay import recovery
from outbox.relay.batches import RETRYABLE, Batches
from outbox.relay.liveness import Liveness
from outbox.relay.metrics import RelayEndpoints
from outbox.relay.scheduling import MoveSchedule
from outbox.relay.stats import Stats
from resolver.apply import Resolution, resolve
from resolver.decide import Owner

log = logging.getLogger("outbox.relay")

# How long the relay waits, per try, for a lost work session's backend to end once
# told to (a backend ends within milliseconds unless stuck in I/O).
PREDECESSOR_WAIT_SECONDS = 5.0

__all__ = ["Relay", "Stats", "StopFlag"]


class StopFlag:
    """Set by SIGTERM/SIGINT/SIGHUP (or a test); checked between batches."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._pipe: tuple[int, int] | None = None  # ``fileno``: made when first asked for
        self._lock = threading.Lock()

    def set(self) -> None:
        self._event.set()
        if self._pipe is not None:
            with contextlib.suppress(OSError):  # full: readable already
                os.write(self._pipe[1], b"x")

    def fileno(self) -> int:
        """A descriptor that turns readable once set: a waiting loop (a dormant relay)
        sleeps on it with its sockets instead of waking every second to look."""
        with self._lock:
            if self._pipe is None:
                read, write = os.pipe()
                os.set_blocking(read, False)
                os.set_blocking(write, False)
                self._pipe = (read, write)
                if self._event.is_set():
                    os.write(write, b"x")
            return self._pipe[0]

    def __bool__(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds, less if set; whether it is set."""
        return self._event.wait(timeout)

    def install_signal_handlers(self) -> None:
        # SIGHUP too: a closed terminal or a supervisor's reload must not kill the
        # relay with batches prepared (its default action is to terminate).
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: self.set())


class Relay:
    """One relay process: its connections, its loop, and its batches in flight."""

    def __init__(
        self,
        settings: Settings,
        *,
        stop: StopFlag | None = None,
        on_batch: Callable[[str, Stats], None] | None = None,
    ) -> None:
        self.settings = settings
        self.stop = stop if stop is not None else StopFlag()
        self.stats = Stats()
        self.store: BatchStore | None = None
        self.liveness: Liveness | None = None
        self.wakeups: WakeupListener | None = None
        self.publisher = Publisher(
            settings.amqp_url,
            connect_timeout=settings.connect_timeout,
            blocked_timeout=max(settings.publish_timeout * 2, 60.0),
            ca_file=settings.amqp_ca_file,
        )
        self.batches = Batches(
            settings, self.publisher, self.stats, may_commit=self._may_commit, on_batch=on_batch
        )
        self.relay_id = ""
        self._next_resolve = 0.0
        self._failures = 0
        # Work and control sessions lost but perhaps still running on the server
        # (``_end_predecessors``).
        self._predecessors: list[Backend] = []
        # The relay id whose control session was lost with batches in flight, and
        # since when: taken back by ``_register`` (the hand-over).
        self._reclaiming: tuple[str, float] | None = None
        # When the scheduled rows are moved into the outbox (``outbox.relay.scheduling``).
        self._moves = MoveSchedule()
        # Dormancy (the module's docstring): when the relay last found work, and
        # whether it sleeps on its wake-up session alone now.
        self._last_work = time.monotonic()
        self.dormant = False

    # -- connections -----------------------------------------------------------
    def start(self) -> None:
        """Connect everything and check the servers; raises OutboxError if not ready.

        Called once before ``run``: a bad configuration fails fast with a clear
        message; outages after this point are retried forever.
        """
        self.store = self.batches.store = self._open_store()
        self.store.check_ready()
        unsafe = replication.warning(self.store.replication())
        if unsafe:
            emit(log, "database.replication_unsafe", logging.WARNING, warning=unsafe)
        self._connect_broker()
        self._connect_database()

    def _open_store(self) -> BatchStore:
        s = self.settings
        return BatchStore(
            s.dsn,
            s.table,
            connect_timeout=s.connect_timeout,
            statement_timeout=s.statement_timeout,
            note_backend=True,
            rescan_seconds=s.rescan_interval,
        )

    def _connect_database(self) -> None:
        s = self.settings
        if self.store is None or self.store.broken:
            if self.store is not None:
                if self.store.backend is not None:
                    self._predecessors.append(self.store.backend)
                self.store.close()
            self.store = self.batches.store = None
            self.store = self.batches.store = self._open_store()
            if self.liveness is not None:
                # The outage that took the work session may have taken the control
                # session too: learn it now, not at the next heartbeat, before
                # anything more is done under a relay id that is already dead.
                self.liveness.probe(s.connect_timeout)
        if self.liveness is not None and self.liveness.lost:
            self._lose_relay_id(self.liveness)
        if self._predecessors:
            self._end_predecessors(self.store)
        if self.wakeups is None or self.wakeups.broken:
            if self.wakeups is not None:
                self.wakeups.close()
            self.wakeups = None
            self.wakeups = WakeupListener(
                s.dsn,
                s.table,
                connect_timeout=s.connect_timeout,
                statement_timeout=s.statement_timeout,
                lock_timeout=s.lock_timeout,
            )
        if self.liveness is None:
            self._register()

    def _lose_relay_id(self, lost: Liveness) -> None:
        """The control session is gone, and the relay id's lock with it.  With batches
        in flight the relay takes the id back (``_register``); the lost session's
        backend, if the server still runs it, holds the lock: it is ended first
        (``_end_predecessors``)."""
        lost.stop(unregister=False)
        self.liveness = None
        if lost.control.backend is not None:
            self._predecessors.append(lost.control.backend)
        if self.batches.in_flight and self._reclaiming is None:
            self._reclaiming = (lost.relay_id, time.monotonic())

    def _register(self) -> None:
        """Start beating: under the relay id lost with batches in flight if it can be
        taken back (the hand-over: ``outbox.relay.batches``), else under a new one.

        Taken back, the batches stay in flight: the ones published are finished by
        their confirms and evidence, the ones in doubt looked up (``Batches.settle``),
        and any a resolver finished meanwhile are let go (``Batches.resumed``).  Held
        elsewhere (a resolver finishing its batches holds its hand-over lock), the
        relay backs off and tries again, for ``relay_timeout`` at most: past that, a
        resolver no longer waits for it (``resolver/decide.py``), and the relay
        draws a new id, settling its batches by what it knows, as a relay did before.
        """
        s = self.settings
        sessions = {
            "interval": s.heartbeat_interval,
            "connect_timeout": s.connect_timeout,
            # A heartbeat that cannot commit in a fraction of relay_timeout is as
            # good as none; bound it so the thread tries again.
            "statement_timeout": min(s.statement_timeout, s.relay_timeout / 4),
        }
        if self._reclaiming is not None:
            relay_id, since = self._reclaiming
            self.liveness = Liveness.resume(relay_id, s.dsn, s.table, **sessions)
            if self.liveness is not None:
                self._reclaiming = None
                emit(log, "relay.resumed", logging.WARNING, relay=relay_id)
                self.batches.resumed()
                self._next_resolve = 0.0
                return
            if time.monotonic() - since < s.relay_timeout:
                raise DatabaseUnavailable(
                    f"the relay id {relay_id} is held elsewhere",
                    "a resolver is finishing its batches; the relay takes it back after",
                )
            self._reclaiming = None
            emit(log, "relay.gave_up_relay_id", logging.WARNING, relay=relay_id)
        # A new relay id: resolvers may finish the old id's batches (after a
        # restart of the server, once it has been up relay_timeout): settle them by
        # what we know, keep none in flight.  (With none in flight: nothing to keep.)
        self.batches.fail(None)
        self.liveness = Liveness.start(s.dsn, s.table, **sessions)
        self.relay_id = self.batches.relay_id = self.liveness.relay_id
        self._next_resolve = 0.0  # resolve dead relays' batches right away
        emit(log, "relay.registered", relay=self.relay_id)

    def _end_predecessors(self, store: BatchStore) -> None:
        """End the work sessions this relay lost, before its batches in doubt are
        looked up (``BatchStore.end_predecessor``): a lost connection's backend may
        still be running the PREPARE or COMMIT PREPARED that was cut off."""
        wait = min(self.settings.statement_timeout, PREDECESSOR_WAIT_SECONDS)
        for backend in list(self._predecessors):
            if not store.end_predecessor(backend, wait):
                raise DatabaseUnavailable(
                    f"the relay's previous database session (backend pid {backend.pid}) "
                    f"is still running {wait:g} s after it was told to end",
                    "its batches in doubt are settled once it is gone; the relay retries. "
                    f"If this repeats, look at pid {backend.pid} in pg_stat_activity",
                )
            self._predecessors.remove(backend)

    def _connect_broker(self) -> None:
        if not self.publisher.connected:
            self.publisher.connect()
            self.batches.triage.forget_exchanges()
            # A restarted broker accepts connections before its streams take records
            # (about 0.5 s later after a kill -9): a batch sent in that gap would be
            # rolled back and sent again.  Probe the ledger before the first batch.
            self.batches.ledger_doubtful = True
            self.publisher.declare_stream(self.settings.ledger_queue, self.settings.ledger_max_age)
            emit(log, "broker.connected", node=self.publisher.address)

    def _reconnect(self, error: OutboxError) -> None:
        """Back off, then reconnect whatever is broken; never raises for outages."""
        self.stats.reconnects += 1
        # Several RabbitMQ nodes: another may answer at once (``outbox.amqp.failover``).
        pause = failover.reconnect_delay(
            self._failures,
            nodes=self.publisher.nodes if isinstance(error, BrokerUnavailable) else 1,
            node_lost=not self.publisher.connected,
            initial=self.settings.backoff_initial,
            maximum=self.settings.backoff_max,
        )
        self._failures += 1
        # Which of the relay's writes failed, if it was one (``relay.batches``).
        fields = {"write": error.write} if error.write else {}
        fields.update({"error": error.message, "sleep": f"{pause:.2f}s"})
        if error.hint:
            fields["hint"] = error.hint
        emit(log, "relay.retry", logging.WARNING, **fields)
        deadline = time.monotonic() + pause
        # Knock on the servers whose session is lost: one that comes back during the
        # wait ends it, so an outage long enough to grow the backoff to its ceiling
        # does not cost that ceiling again once it is over (``relay.recovery``).
        watch = recovery.RecoveryWatch(self._lost_servers(error), now=time.monotonic())
        while not self.stop and time.monotonic() < deadline:
            if watch.back(time.monotonic()):
                # A server that was down is back: the failures were the outage's,
                # and a session it killed silently must not pay for them again.
                self._failures = 0
                emit(
                    log, "relay.server_back", waited=f"{pause - (deadline - time.monotonic()):.2f}s"
                )
                break
            step = min(0.2, max(0.0, deadline - time.monotonic()))
            if self.publisher.connected:
                # Serve the connection while waiting: heartbeats, and the broker's
                # connection.unblocked when a resource alarm clears.
                self.publisher.wait(step)
            else:
                time.sleep(step)
        try:
            self._connect_database()
            self._connect_broker()
        except (DatabaseUnavailable, BrokerUnavailable) as exc:
            emit(log, "relay.reconnect_failed", logging.WARNING, error=exc.message)

    def _lost_servers(self, error: OutboxError) -> list[list[recovery.Address]]:
        """Where the servers answer whose session ``error`` (or an earlier one) lost."""
        lost = []
        if isinstance(error, BrokerUnavailable) and not self.publisher.connected:
            lost.append(self.publisher.servers)
        sessions = (self.store, self.wakeups)
        if (
            isinstance(error, DatabaseUnavailable)
            or any(session is None or session.broken for session in sessions)
            or self.liveness is None
            or self.liveness.lost
        ):
            lost.append(recovery.database_addresses(self.settings.dsn))
        return lost

    def close(self) -> None:
        if self.liveness is not None:
            self.liveness.stop(unregister=True)
        if self.wakeups is not None:
            self.wakeups.close()
        if self.store is not None:
            # The next session of any relay starts where this one got
            # (``outbox.db.front``); a failure here costs that session a longer walk.
            with contextlib.suppress(OutboxError):
                if self.store.idle:
                    self.store.save_front()
            self.store.close()
        self.publisher.close()
        self.liveness = None
        self.wakeups = None
        self.store = self.batches.store = None

    # -- the process's life ------------------------------------------------------
    def serve(
        self, *, drain: bool = False, metrics_port: int = 0, metrics_address: str = "0.0.0.0"
    ) -> Stats:
        """What ``outbox relay`` runs (``outbox.lifecycle.serve``): the endpoints on
        ``metrics_port`` (0: none), ``start``, the collector tuned for the batch
        size, ``run`` until stopped, ``close``, and the ``relay.stopped`` event.
        Signals are the caller's (``StopFlag.install_signal_handlers``)."""

        def endpoints() -> RelayEndpoints:
            return RelayEndpoints(self, port=metrics_port, address=metrics_address)

        return lifecycle.serve(
            "relay",
            start=self.start,
            run=lambda: self.run(drain=drain),
            close=self.close,
            endpoints=endpoints if metrics_port else None,
            stopped="relay.stopped",
            summary=Stats.summary,
            young_objects=self.settings.batch_size,
        )

    # -- the loop --------------------------------------------------------------
    def run(self, *, drain: bool = False) -> Stats:
        """Relay until stopped (or, with ``drain``, until nothing is claimable)."""
        if self.store is None:
            self.start()
        busy_steps = 0  # steps in a row that claimed rows
        failed = False
        try:
            while not self.stop:
                self.stats.last_progress = time.monotonic()
                if failed:
                    # The failed step's traceback held its frames, and they its
                    # batches' rows: reference cycles.  Free them now, not whenever
                    # the collector next runs (``lifecycle.collect_young_less_often``):
                    # a failure repeated must not hold a batch of large rows each.
                    gc.collect(1)
                    failed = False
                try:
                    # A reconnect that failed earlier leaves a session missing.
                    self._connect_database()
                    self._connect_broker()
                    if self.batches.in_doubt:
                        self.batches.settle()
                    self._maintain()
                    if time.monotonic() >= self._moves.next_move:
                        self._move_due()
                    committed = self.stats.batches_committed
                    progress = self.batches.step()
                    if progress:
                        self._last_work = time.monotonic()
                    # Claims, not commits: a trickle (a row claimed, then its batch
                    # committed by a step that claims nothing) keeps the wake-up lock,
                    # so its commits wake the relay by NOTIFY; letting the lock go there
                    # cost a lock round trip and a dozen polls per row (``_busy``).
                    busy_steps = busy_steps + 1 if self.batches.claimed else 0
                    if busy_steps == 2:
                        self._busy()
                    if not progress or self.stats.batches_committed > committed:
                        # Only a commit (or nothing to do) proves the writes work
                        # again: a step that published and committed nothing, between
                        # two failures, must not bring the backoff back to its start.
                        self._failures = 0
                    self.stats.last_error = None
                    if progress:
                        continue
                    if drain and self._drained():
                        break
                    if self._dormant_due(time.monotonic()):
                        self._sleep_dormant()
                        continue
                    self._wait_for_work()
                except RETRYABLE as exc:
                    self.stats.last_error = exc.message
                    if isinstance(exc, PreparedSlotsExhausted):
                        emit(log, "relay.prepared_slots_exhausted", logging.WARNING, hint=exc.hint)
                    self._reconnect(exc)
                    failed, busy_steps = True, 0
            with contextlib.suppress(*RETRYABLE):
                self.batches.finish_in_flight()  # stopping: finish what is in flight
        finally:
            self.close()
        return self.stats

    def _drained(self) -> bool:
        """Nothing claimable, and no batch that a relay may yet take back (its
        session ended with the server) or that someone is finishing: their rows
        come back if rolled back."""
        assert self.store is not None
        pending = any(
            r.decision.owner is Owner.RECONNECTING or r.outcome == "held_elsewhere"
            for r in self._resolve_dead_relays()
        )
        return not pending and not self.store.has_claimable_rows()

    def _maintain(self) -> None:
        now = time.monotonic()
        if now >= self._next_resolve:
            self._next_resolve = now + self.settings.resolve_interval
            self._resolve_dead_relays()

    def _resolve_dead_relays(self) -> list[Resolution]:
        assert self.store is not None
        resolutions = resolve(self.store, self.settings)
        self.stats.batches_resolved += sum(1 for r in resolutions if r.finished)
        return resolutions

    def _wait_for_work(self) -> None:
        """Sleep until a NOTIFY arrives or a poll finds rows (serving AMQP).

        Waiting, the relay holds the wake-up lock, so applications' commits notify
        (``WakeupListener``, schema 0005); once busy it lets the lock go
        (``_busy``), so that commits do not notify while it claims anyway.  A commit
        whose INSERT ran while the lock was not held notifies nobody, however late
        it commits: after taking the lock anew the relay therefore polls soon and
        then less often (``WakeupListener.poll_pause``), each pause twice the one
        before, up to ``poll_interval``, at which a longer transaction's commit is
        found, as any commit was before schema 5 without a NOTIFY.

        Idle cost: a dozen polls when it falls idle after being busy, then one per
        ``poll_interval`` on the wake-up session, one heartbeat per
        ``heartbeat_interval`` (its own thread) and one resolve pass per
        ``resolve_interval``; claims only when there is work, and during a pass of the
        safety net (every 10 minutes, up to 5) one a second, each reading a slice.
        """
        wakeups = self.wakeups
        assert wakeups is not None
        if wakeups.take_notifications():
            self._moves.woken()
            return
        if not wakeups.wanting and wakeups.want_wakeups(self._front()):
            return
        pause = wakeups.poll_pause(self.settings.poll_interval)
        deadline = time.monotonic() + pause
        while not self.stop:
            now = time.monotonic()
            self.stats.last_progress = now  # idle is progress too (liveness)
            if self.store is not None and self.store.rescan_due():
                return  # a claim with the safety net's next slice (``BatchStore.rescan_due``)
            if self._dormant_due(now):
                return  # one more step, then dormant (``run``)
            if self.liveness is None or self.liveness.lost:
                raise DatabaseUnavailable("lost the relay's control session while idle")
            if now >= self._next_resolve:
                self._next_resolve = now + self.settings.resolve_interval
                if any(r.finished for r in self._resolve_dead_relays()):
                    return  # rolled-back rows are claimable again, without a NOTIFY
            if now >= self._moves.idle_until(now):
                # Rows came due: move them, and claim whether this relay moved them or
                # another one did (its move does not notify: it would wake everyone).
                self._move_due()
                return
            if now >= deadline:
                # Also takes the lock if someone held it exclusively before.
                if wakeups.want_wakeups(self._front()):
                    return
                # A commit that notified nobody may have scheduled a row due sooner.
                if self._move_due():
                    return
                pause = min(pause * 2, self.settings.poll_interval)
                deadline = now + pause
            remaining = min(deadline, self._next_resolve, self._moves.idle_until(now)) - now
            if remaining <= 0:
                continue
            # Wake at least every second so SIGTERM is noticed promptly.
            if self.publisher.wait(min(remaining, 1.0), wake_fd=wakeups.fileno()):
                wakeups.take_notifications()
                self._moves.woken()
                return
            if not self.publisher.connected:
                raise BrokerUnavailable("lost the RabbitMQ connection while idle")

    # -- dormancy (the module's docstring) -------------------------------------
    def _dormant_due(self, now: float) -> bool:
        """Idle for ``dormant_after`` (0: never), nothing in flight or in doubt."""
        after = self.settings.dormant_after
        return (
            after > 0
            and now - self._last_work >= after
            and not self.batches.in_flight
            and self.store is not None
            and self.store.idle
            and self.wakeups is not None
            and not self.wakeups.broken
        )

    def _sleep_dormant(self) -> None:
        """Go dormant, wait on the wake-up session until woken (or stopped), and
        return with the work and control sessions closed: the loop's
        ``_connect_database`` opens them again (waking)."""
        wakeups, store = self.wakeups, self.store
        assert wakeups is not None and store is not None
        front = store.front
        with contextlib.suppress(OutboxError):
            # The next session (this relay's, waking) starts where this one got.
            store.save_front()
        store.close()
        self.store = self.batches.store = None
        if self.liveness is not None:
            self.liveness.stop(unregister=True)
            self.liveness = None
        self.dormant = True
        emit(log, "relay.dormant", idle=f"{time.monotonic() - self._last_work:.0f}s")
        try:
            reason = self._dormant_wait(wakeups, front)
        finally:
            self.dormant = False
            self._last_work = time.monotonic()
        if reason:
            emit(log, "relay.woken", reason=reason)

    def _dormant_wait(self, wakeups: WakeupListener, front: ClaimFront) -> str | None:
        """Wait until something wakes a dormant relay; what did (None: stopped).
        Raises as ``_wait_for_work`` does when a session is lost (the loop then
        reconnects, which wakes it)."""
        if not wakeups.wanting:
            wakeups.want_wakeups(front)
        s = self.settings
        # One look (one statement) every resolve_interval at most: dead relays'
        # batches each time, rows once ``_dormant_poll`` has passed.
        every = min(s.resolve_interval, self._dormant_poll())
        next_look, next_poll = time.monotonic(), time.monotonic() + self._dormant_poll()
        wake = (wakeups.fileno(), self.stop.fileno())
        while not self.stop:
            now = time.monotonic()
            self.stats.last_progress = now  # dormant is progress too (liveness)
            if wakeups.take_notifications():
                self._moves.woken()
                return "notify"
            if now >= next_look:
                if not wakeups.wanting and wakeups.want_wakeups(front):
                    return "poll"  # the lock taken at last (it was held exclusively)
                rows, orphaned = wakeups.dormant_look(front, s.relay_timeout)
                if orphaned:
                    return "orphaned_batches"
                if now >= next_poll:
                    if rows:
                        return "poll"
                    next_poll = now + self._dormant_poll()
                next_look = now + every
            # A failed move is tried again after its pause (``MoveSchedule.failed``).
            move_at = max(self._moves.idle_until(now), self._moves.next_move)
            if now >= move_at and self._move_due():
                return "scheduled"
            move_at = max(self._moves.idle_until(now), self._moves.next_move)
            until = min(next_look, move_at)
            # No tick: the wake-up session's socket, the stop flag's pipe and the
            # timers above end the wait (50 dormant targets: ``outbox.fleet``).
            if self.publisher.wait(max(until - now, 0.0), wake_fd=wake):
                if self.stop:
                    break
                wakeups.take_notifications()
                self._moves.woken()
                return "notify"
            if not self.publisher.connected:
                raise BrokerUnavailable("lost the RabbitMQ connection while dormant")
        return None

    def _dormant_poll(self) -> float:
        """How often a dormant relay looks for rows (``WakeupListener.dormant_look``):
        every ``poll_interval`` while it does not hold the wake-up lock, else every
        ``dormant_after`` at least.  Holding the lock since before it fell idle, it is
        notified of every commit but one whose INSERT ran before the lock was taken
        (a transaction open longer than ``dormant_after``).  Measured: a poll every
        ``poll_interval`` (5 s) and a tick a second cost 50 dormant targets 2.1% of a
        core (``outbox.fleet.footprint``; the module's docstring has the rest)."""
        s = self.settings
        wanting = self.wakeups is not None and self.wakeups.wanting
        return max(s.poll_interval, s.dormant_after) if wanting else s.poll_interval

    def _move_due(self) -> int:
        """Move the scheduled rows that are due into the outbox; how many moved.

        Crash right after: the rows are in the outbox, committed, claimed by any
        relay; before it, still scheduled, moved by the next mover (a sweep)."""
        wakeups = self.wakeups
        assert wakeups is not None
        now = time.monotonic()
        sweep = self._moves.sweep_now(now)
        try:
            moved = wakeups.move_due(self._moves.covered, sweep=sweep)
        except RETRYABLE as exc:
            if wakeups.broken:
                raise  # an outage: the loop reconnects
            # The claims go on: a lock or an error on the scheduled rows only delays
            # them (logged, tried again after a pause).
            emit(log, "relay.move_failed", logging.WARNING, error=exc.message)
            self._moves.failed(now)
            return 0
        full = moved.rows >= MOVE_LIMIT
        self._moves.moved(moved, now, swept=sweep, full=full)
        self.stats.scheduled_moved += moved.rows
        if moved.rows:
            faults.reached("after_move")
        return moved.rows

    def _front(self) -> ClaimFront | None:
        """Where the work session's claims start: the idle polls look there too, not
        at the dead rows behind it (``outbox.db.front``)."""
        return self.store.front if self.store is not None else None

    def _busy(self) -> None:
        """A second step in a row claimed rows: applications' commits need not notify
        until the relay waits again (one step after a wake-up keeps the lock, so a
        trickle of commits costs no round trip).  Taking the lock back costs a round
        trip and the polls that follow it (``WakeupListener.poll_pause``): a step
        that only committed the batch before (a trickle: one row, then nothing) does
        not count, or every row of a trickle would pay them.  Measured with ``outbox
        bench --fleet --fleet-runs baseline,one --fleet-databases 10``: a relay at 20
        single-row commits/s spent 8.5 ms of CPU per row, most of it those polls."""
        wakeups = self.wakeups
        if wakeups is not None and wakeups.wanting and not wakeups.broken:
            wakeups.stop_wanting_wakeups()

    def _may_commit(self) -> bool:
        """False once our heartbeat is so old a resolver may presume us dead.

        The heartbeat has its own thread and session (``outbox.relay.liveness``), so only
        a control session that cannot reach the server makes it old, never a slow
        statement of this loop.  A control session just lost does not stop the
        evidence: a ledger record is safe whoever finishes the batch (a resolver
        commits from it; one that rolled back first only makes it unused), and
        the relay, taking its id back, commits the batch from it (the hand-over).
        """
        if self.liveness is None:
            return False
        return self.liveness.age < self.settings.relay_timeout - self.settings.heartbeat_interval
