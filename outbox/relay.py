"""The relay: claim → PREPARE → publish → record → COMMIT PREPARED, forever.

State machine of one batch (``gid`` = ``obx:<table>:<relay_id>:<seq>``)::

    IDLE ──claim──▶ CLAIMED ──PREPARE──▶ PREPARED ──publish──▶ PUBLISHED
      ▲               │ (0 rows: ROLLBACK)     │ nack / lost / timeout     │
      │               ▼                        ▼                           ▼
      │             IDLE                 ROLLBACK PREPARED         dead letters recorded
      │                                  (rows claimable again)            │
      │                                                                   ▼
      └──────────── COMMIT PREPARED ◀──── EVIDENCE (gid in the ledger) ◀───┘

With ``pipeline`` a relay has at most two batches between PREPARE and COMMIT
PREPARED.  One step of the loop then is: claim and PREPARE batch N+1 while the
broker persists N; wait for N's confirms, record its dead letters, send N's
ledger record; publish N+1 (its own PREPARE succeeded); wait for N's ledger
confirm and COMMIT PREPARED N.  Each batch still walks the machine above in
order; N+1 is published only after its PREPARE succeeded and after N's messages
were all confirmed.  ``--no-pipeline``: claim, PREPARE, publish, record, commit
one batch at a time.

A batch becomes ``UNSETTLED`` when the database connection drops during PREPARE,
ROLLBACK PREPARED or COMMIT PREPARED: its outcome is unknown, and the relay looks
the gid up after reconnecting (present → finish it by the evidence rule; gone →
someone finished it).  Nothing is published for a batch whose PREPARE is not known
to have succeeded.  Pipelined, a batch already published when a database failure
hits (the next PREPARE cut off or out of slots, COMMIT PREPARED of the previous
cut off) stays in flight and is finished after the reconnect, as long as the
control session, and with it the relay id, survived (``survives_failure``);
otherwise, and after any broker failure, every open batch is settled by its
evidence (no ledger confirm → ROLLBACK).

What a crash (kill -9) leaves at each step, and who cleans up:

=============================  ===============================  ==================================
crash right after              state left                       outcome (by whom)
=============================  ===============================  ==================================
claim (before PREPARE)         open transaction, dies with the  rows free at once; no duplicate
                               session
PREPARE                        prepared xact holding the rows   no evidence → ROLLBACK (resolver);
                                                                no duplicate
some messages published        some messages on the broker      no evidence → ROLLBACK (resolver);
                                                                duplicates ≤ batch
all messages confirmed         every message on the broker      no evidence → ROLLBACK (resolver);
                                                                duplicates = batch (tiny window)
ledger record confirmed        evidence on the broker           COMMIT (resolver); no duplicate
COMMIT PREPARED sent           unknown to the relay             gid gone → done; present → COMMIT
=============================  ===============================  ==================================

Pipelined, the crash also finds the other batch in flight at its own step of the
table (N+1 is at most "PREPARE" while N is before "ledger record confirmed", and
at most "all messages confirmed" while N is after it), so a crash leaves at most
two batches to resolve.  Duplicates per crash: ≤ batch_size serially, ≤ 2 x
batch_size pipelined.  Both batches are duplicated only if N's ledger record is
lost with the relay (or the broker connection) after N+1 was published; at each
crash point of ``outbox/faults.py`` a kill costs at most one batch, as
``tests/integration/test_faults_crash.py`` pins down.  A database outage costs
at most one batch in either mode, and none pipelined while the control session
survives.

"resolver" is any relay's periodic pass (``resolver.resolve``) or ``outbox
resolve``; it acts only once the owner's control session (advisory lock) is gone,
or its heartbeat is older than ``relay_timeout`` (partition).  A relay whose own
heartbeat is that stale no longer writes evidence for its batch: it rolls it
back instead, so a resolver and the relay never disagree about a batch.  The
heartbeat is written by a thread of its own on the control session
(``outbox.liveness``), never from this loop: a slow claim cannot make the relay
look partitioned.

Sessions: the work connection (claims, 2PC, resolver passes; every statement
bounded by ``statement_timeout``, and the server checks every 2 s that we are
still there), the control session (lock and heartbeat, its thread only) and the
wake-up session (LISTEN and the fallback poll).

Transient failures (broker down or blocked, nack, confirm timeout, database
restart) roll the batch back when possible and retry with backoff; they never
dead-letter a row.  Rows that can never be published (``triage.Triage``: bad
names, sizes or headers, values that cannot be loaded, a missing exchange, a
refusal learnt from the broker; and unroutable returns) become dead letters in
the same pass.  A refusal nobody foresaw (the broker closes the channel or the
connection because of what was published) makes the rows it left in doubt
suspects, published one at a time until the culprit is refused alone and
dead-lettered (``isolation.Suspects``).  A dead-letter write that PostgreSQL
refuses rolls the batch back and backs off; until a write succeeds, known dead
letters are recorded before anything is published.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence

from outbox import failover, faults, ledger, replication
from outbox.config import Settings
from outbox.durations import Durations
from outbox.errors import (
    BrokerUnavailable,
    DatabaseUnavailable,
    DeadLettersUnwritable,
    MissingPrivileges,
    OutboxError,
    OutcomeUnknown,
    PreparedSlotsExhausted,
)
from outbox.events import emit
from outbox.gid import Gid
from outbox.liveness import Liveness
from outbox.message import DeadLetter, OutboxRow
from outbox.publisher import Message, Outcome, Pending, Publisher
from outbox.store import BatchStore, WakeupListener
from outbox.triage import Triage

log = logging.getLogger("outbox.relay")

# A claim is an index scan of at most batch_size rows: milliseconds.  Slower means a
# bad plan, a bloated table or an overloaded server: say so in the log.
SLOW_CLAIM_SECONDS = 1.0


@dataclasses.dataclass
class Stats:
    """Counters of one relay process (exported as metrics, shown in logs)."""

    batches_committed: int = 0
    batches_rolled_back: int = 0
    batches_resolved: int = 0
    messages_published: int = 0
    dead_letters: int = 0
    reconnects: int = 0
    # Messages accepted, or sent and never confirmed, in batches then rolled back.
    duplicates_possible: int = 0
    batch_seconds: Durations = dataclasses.field(default_factory=Durations)  # committed batches
    claim_seconds: Durations = dataclasses.field(default_factory=Durations)  # every claim
    slowest_claim: float = 0.0  # seconds
    largest_claim: int = 0  # rows; never more than batch_size
    # For health checks: when the loop last went round, and why its last pass failed.
    last_progress: float = dataclasses.field(default_factory=time.monotonic)
    last_error: str | None = None


@dataclasses.dataclass
class _Unsettled:
    gid: str
    evidence: bool  # the ledger record was confirmed: the batch must be committed
    published: int = 0  # for the stats once it is settled
    dead: int = 0


@dataclasses.dataclass(eq=False)
class _Batch:
    """A prepared batch on its way: sent, then evidenced, then committed."""

    gid: str
    rows: Sequence[OutboxRow]
    started: float
    good: list[OutboxRow] = dataclasses.field(default_factory=list)
    dead: list[DeadLetter] = dataclasses.field(default_factory=list)
    sent: list[Pending] = dataclasses.field(default_factory=list)
    ledger: Pending | None = None
    published: int = 0
    interrupted: bool = False  # a failure cut the step that was to finish it
    isolated: bool = False  # a suspect published alone was refused: it names the row
    dead_recorded: int = 0  # dead letters recorded before publishing
    unpublishable: OutboxError | None = None  # why nothing was published: roll back


def survives_failure(error: OutboxError) -> bool:
    """Whether a batch already published is still finished by its relay after ``error``.

    Its PREPARE succeeded, so the batch is durable and any session of the relay may
    finish it; while the broker connection lives, its confirms still arrive.  A
    database failure (lost work connection, PREPARE of the next batch cut off or
    refused for want of slots) therefore need not cost a batch of duplicates: the
    batch is finished after reconnecting, provided the control session (and with
    it the relay id that keeps resolvers away) survived.  A broker failure puts
    its confirms in doubt: it is rolled back.
    """
    return not isinstance(error, BrokerUnavailable)


class StopFlag:
    """Set by SIGTERM/SIGINT/SIGHUP (or a test); checked between batches."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def __bool__(self) -> bool:
        return self._event.is_set()

    def install_signal_handlers(self) -> None:
        # SIGHUP too: a closed terminal or a supervisor's reload must not kill the
        # relay with batches prepared (its default action is to terminate).
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: self.set())


def to_message(row: OutboxRow) -> Message:
    return Message(
        exchange=row.exchange,
        routing_key=row.routing_key,
        body=row.payload,
        message_id=str(row.message_id),
        content_type=row.content_type,
        headers=row.headers,
        timestamp=row.created_at,
    )


class Relay:
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
        self._on_batch = on_batch
        self.store: BatchStore | None = None
        self.liveness: Liveness | None = None
        self.wakeups: WakeupListener | None = None
        self.publisher = Publisher(
            settings.amqp_url,
            connect_timeout=settings.connect_timeout,
            blocked_timeout=max(settings.publish_timeout * 2, 60.0),
            ca_file=settings.amqp_ca_file,
        )
        self.relay_id = ""
        self._seq = 0
        self._unsettled: list[_Unsettled] = []
        # Prepared by us and not yet finished, by gid (evidence: ledger record confirmed).
        self._open: dict[str, _Unsettled] = {}
        self._sent: _Batch | None = None  # pipelined: sent, finished by the next step
        self.triage = Triage(settings.max_message_bytes, self.publisher.exchange_exists)
        self._next_resolve = 0.0
        self._failures = 0
        self._ledger_doubtful = False  # the last ledger write failed
        self._dead_letters_failing = False  # the last dead-letter write was refused

    # -- connections -----------------------------------------------------------
    def start(self) -> None:
        """Connect everything and check the servers; raises OutboxError if not ready.

        Called once before ``run``: a bad configuration fails fast with a clear
        message; outages after this point are retried forever.
        """
        self.store = self._open_store()
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
        )

    def _connect_database(self) -> None:
        s = self.settings
        if self.store is None or self.store.broken:
            if self.store is not None:
                self.store.close()
            self.store = None
            self.store = self._open_store()
        if self.wakeups is None or self.wakeups.broken:
            if self.wakeups is not None:
                self.wakeups.close()
            self.wakeups = None
            self.wakeups = WakeupListener(s.dsn, s.table, connect_timeout=s.connect_timeout)
        if self.liveness is None or self.liveness.lost:
            if self.liveness is not None:
                self.liveness.stop(unregister=False)
                # Our relay id dies with the session, and resolvers may now finish
                # its batches: settle them by what we know, keep none in flight.
                self._give_up_open_batches()
            self.liveness = None
            # A new control session gets a new relay id: the old session may still
            # hold the old lock on the server until it notices it is dead.
            self.liveness = Liveness.start(
                s.dsn,
                s.table,
                interval=s.heartbeat_interval,
                connect_timeout=s.connect_timeout,
                # A heartbeat that cannot commit in a fraction of relay_timeout is
                # as good as none; bound it so the thread tries again.
                statement_timeout=min(s.statement_timeout, s.relay_timeout / 4),
            )
            self.relay_id = self.liveness.relay_id
            self._next_resolve = 0.0  # resolve dead relays' batches right away
            emit(log, "relay.registered", relay=self.relay_id)

    def _connect_broker(self) -> None:
        if not self.publisher.connected:
            self.publisher.connect()
            self.triage.forget_exchanges()
            # A restarted broker accepts connections before its streams take records
            # (about 0.5 s later after a kill -9): a batch sent in that gap would be
            # rolled back and sent again.  Probe the ledger before the first batch.
            self._ledger_doubtful = True
            self.publisher.declare_stream(self.settings.ledger_queue, self.settings.ledger_max_age)
            emit(log, "broker.connected", node=self.publisher.address)

    def _reconnect(self, error: OutboxError) -> None:
        """Back off, then reconnect whatever is broken; never raises for outages."""
        self.stats.reconnects += 1
        # Several RabbitMQ nodes: another may answer at once (``outbox.failover``).
        pause = failover.reconnect_delay(
            self._failures,
            nodes=self.publisher.nodes if isinstance(error, BrokerUnavailable) else 1,
            node_lost=not self.publisher.connected,
            initial=self.settings.backoff_initial,
            maximum=self.settings.backoff_max,
        )
        self._failures += 1
        hint = {"hint": error.hint} if error.hint else {}
        emit(
            log, "relay.retry", logging.WARNING, error=error.message, sleep=f"{pause:.2f}s", **hint
        )
        deadline = time.monotonic() + pause
        while not self.stop and time.monotonic() < deadline:
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

    def close(self) -> None:
        if self.liveness is not None:
            self.liveness.stop(unregister=True)
        if self.wakeups is not None:
            self.wakeups.close()
        if self.store is not None:
            self.store.close()
        self.publisher.close()
        self.liveness = None
        self.wakeups = None
        self.store = None

    # -- the loop --------------------------------------------------------------
    def run(self, *, drain: bool = False) -> Stats:
        """Relay until stopped (or, with ``drain``, until nothing is claimable)."""
        if self.store is None:
            self.start()
        try:
            while not self.stop:
                self.stats.last_progress = time.monotonic()
                try:
                    # A reconnect that failed earlier leaves a session missing.
                    self._connect_database()
                    self._connect_broker()
                    if self._unsettled:
                        self._settle()
                    self._maintain()
                    claimed = self.process_one_batch()
                    self._failures = 0
                    self.stats.last_error = None
                    if claimed:
                        continue
                    if drain and self._drained():
                        break
                    self._wait_for_work()
                except (
                    DatabaseUnavailable,
                    BrokerUnavailable,
                    OutcomeUnknown,
                    MissingPrivileges,  # revoked while running: back off until granted
                ) as exc:
                    self.stats.last_error = exc.message
                    self._reconnect(exc)
                except PreparedSlotsExhausted as exc:
                    self.stats.last_error = exc.message
                    emit(log, "relay.prepared_slots_exhausted", logging.WARNING, hint=exc.hint)
                    self._reconnect(exc)
            with contextlib.suppress(
                DatabaseUnavailable, BrokerUnavailable, OutcomeUnknown, MissingPrivileges
            ):
                try:
                    self._finish_sent()  # stopping: finish the batch in flight, claim no more
                finally:
                    self._give_up_open_batches()
                    if self._unsettled:
                        self._settle()
        finally:
            self.close()
        return self.stats

    def _drained(self) -> bool:
        assert self.store is not None
        self._resolve_dead_relays()
        return not self.store.has_claimable_rows()

    def _maintain(self) -> None:
        now = time.monotonic()
        if now >= self._next_resolve:
            self._next_resolve = now + self.settings.resolve_interval
            self._resolve_dead_relays()

    def _resolve_dead_relays(self) -> int:
        from resolver.apply import resolve  # the resolver imports outbox, not the reverse

        assert self.store is not None
        finished = 0
        for resolution in resolve(self.store, self.settings):
            if resolution.finished:
                finished += 1
        self.stats.batches_resolved += finished
        return finished

    def _wait_for_work(self) -> None:
        """Sleep until a NOTIFY arrives or the fallback poll finds rows (serving AMQP).

        Idle cost: one poll per ``poll_interval`` on the wake-up session, one
        heartbeat per ``heartbeat_interval`` (its own thread) and one resolve pass
        per ``resolve_interval``; claims only when there is work.
        """
        wakeups = self.wakeups
        assert wakeups is not None
        if wakeups.take_notifications():
            return
        deadline = time.monotonic() + self.settings.poll_interval
        while not self.stop:
            now = time.monotonic()
            self.stats.last_progress = now  # idle is progress too (liveness)
            if self.liveness is None or self.liveness.lost:
                raise DatabaseUnavailable("lost the relay's control session while idle")
            if now >= self._next_resolve:
                self._next_resolve = now + self.settings.resolve_interval
                if self._resolve_dead_relays():
                    return  # rolled-back rows are claimable again, without a NOTIFY
            if now >= deadline:
                if wakeups.rows_waiting():
                    return
                deadline = now + self.settings.poll_interval
            remaining = min(deadline, self._next_resolve) - now
            if remaining <= 0:
                continue
            # Wake at least every second so SIGTERM is noticed promptly.
            if self.publisher.wait(min(remaining, 1.0), wake_fd=wakeups.fileno()):
                wakeups.take_notifications()
                return
            if not self.publisher.connected:
                raise BrokerUnavailable("lost the RabbitMQ connection while idle")

    def _next_gid(self) -> str:
        self._seq += 1
        return str(Gid(self.settings.table, self.relay_id, self._seq))

    # -- one batch -------------------------------------------------------------
    def process_one_batch(self) -> int:
        """One step of the loop; returns the rows claimed.

        Without ``pipeline``: claim, PREPARE, publish, record, COMMIT PREPARED one
        batch.  With it two batches overlap, and a step is:

        1. claim and PREPARE batch N+1, while the broker persists batch N;
        2. wait for N's confirms, record its dead letters, send N's ledger record;
        3. publish N+1 (its PREPARE succeeded in 1);
        4. wait for N's ledger confirm, COMMIT PREPARED N.

        Each batch still goes claim → PREPARE → publish → confirms → ledger →
        COMMIT PREPARED in that order, and nothing is published before its own
        PREPARE is known to have succeeded.  At most two batches of a relay are
        prepared at once, so a crash leaves at most two to resolve (each by the
        crash table) and duplicates ≤ 2 x batch_size.
        """
        try:
            if not self.settings.pipeline:
                batch = self._claim_and_prepare()
                if batch is not None:
                    self._send(batch)
                    self._record_evidence(batch)
                    self._commit(batch)
                return len(batch.rows) if batch else 0
            if self._sent is not None and self._sent.interrupted:
                # Published before a database failure that it survived: finish it
                # before preparing another (which may be what failed, e.g. no slot).
                self._finish_sent()
            batch = self._claim_and_prepare()
            previous, self._sent = self._sent, None
            if previous is not None:
                self._record_evidence(previous)
            if batch is not None:
                self._send(batch)
                self._sent = batch
            if previous is not None:
                self._commit(previous)
            if batch is not None and batch.unpublishable is not None:
                self._finish_sent()  # nothing was published: roll it back now, back off
            return len(batch.rows) if batch else 0
        except (
            DatabaseUnavailable,
            BrokerUnavailable,
            OutcomeUnknown,
            PreparedSlotsExhausted,
            MissingPrivileges,
        ) as exc:
            self._give_up_open_batches(keep=self._sent if survives_failure(exc) else None)
            raise

    def _finish_sent(self) -> None:
        """Record and commit the batch already sent, claiming nothing new."""
        previous, self._sent = self._sent, None
        if previous is not None:
            self._record_evidence(previous)
            self._commit(previous)

    def _give_up_open_batches(self, *, keep: _Batch | None = None) -> None:
        """After a failure, every batch we prepared and did not finish is settled later
        (by the evidence we have), except ``keep``, which stays in flight."""
        self._sent = keep
        known = {u.gid for u in self._unsettled}
        for gid, unsettled in list(self._open.items()):
            if keep is not None and gid == keep.gid:
                keep.interrupted = True
                continue
            if gid not in known:
                self._unsettled.append(unsettled)
            del self._open[gid]

    def _claim_and_prepare(self) -> _Batch | None:
        """Claim rows and PREPARE them (crash table: "claim", "PREPARE")."""
        store = self.store
        assert store is not None
        started = time.monotonic()
        if self.publisher.blocked:
            # Publishing into a blocked connection only queues messages that a
            # timeout would then put in doubt: claim nothing until the alarm clears.
            raise BrokerUnavailable("RabbitMQ is blocking publishers (resource alarm)")
        if self._ledger_doubtful:
            self._probe_ledger()
        claim_started = time.monotonic()
        rows = store.claim_batch(self.settings.batch_size, self.settings.batch_max_bytes)
        self._observe_claim(time.monotonic() - claim_started, len(rows))
        if not rows:
            store.abandon_claim()
            return None
        self._crash_point("after_claim")
        gid = self._next_gid()
        try:
            store.prepare(gid)
        except OutcomeUnknown:
            self._unsettled.append(_Unsettled(gid, evidence=False))
            raise
        # From here on the batch is durable and undecided until finished.
        self._open[gid] = _Unsettled(gid, evidence=False)
        self._crash_point("after_prepare")
        return _Batch(gid, rows, started)

    def _observe_claim(self, seconds: float, rows: int) -> None:
        stats = self.stats
        stats.claim_seconds.observe(seconds)
        stats.slowest_claim = max(stats.slowest_claim, seconds)
        stats.largest_claim = max(stats.largest_claim, rows)
        if seconds >= SLOW_CLAIM_SECONDS:
            emit(log, "claim.slow", logging.WARNING, ms=f"{seconds * 1000:.0f}", rows=rows)

    def _send(self, batch: _Batch) -> None:
        """Publish the batch's messages without waiting ("some messages published").

        Suspects go first, one at a time (``_send_alone``).  While dead-letter
        writes are refused, the dead letters known before publishing are recorded
        first, and nothing is published if that fails: a table the relay may not
        write costs no further duplicates.
        """
        batch.dead, good = self.triage.sort_out(batch.rows)
        if self._dead_letters_failing and batch.dead and not self._record_dead_first(batch):
            return
        suspects, others = self.triage.isolate(good)
        batch.good = suspects + others
        if suspects and not self._send_alone(batch, suspects):
            return
        messages = [to_message(r) for r in others]
        if faults.armed("mid_publish") and len(messages) > 1:
            half = len(messages) // 2
            first = self.publisher.send(messages[:half])
            self.publisher.confirmed(first, self.settings.publish_timeout)
            self._crash_point("mid_publish")
            batch.sent += [first, self.publisher.send(messages[half:])]
        elif messages:
            if len(messages) > 1:
                faults.reached("mid_publish")  # not armed: counts towards OUTBOX_CRASH_AT=…:n
            batch.sent.append(self.publisher.send(messages))

    def _send_alone(self, batch: _Batch, suspects: Sequence[OutboxRow]) -> bool:
        """Publish each suspect alone, waiting for its confirm; False at the first
        failure, which then names its row (``isolation.Suspects``)."""
        timeout = self.settings.publish_timeout
        # Nothing else may be in flight when a refusal closes the channel.
        self.publisher.wait_for_confirms(timeout)
        for row in suspects:
            pending = self.publisher.send([to_message(row)])
            batch.sent.append(pending)
            [delivery] = self.publisher.confirmed(pending, timeout)
            if delivery.outcome in (Outcome.NACKED, Outcome.UNKNOWN):
                batch.isolated = True
                return False
            self.triage.suspects.clear([row.id])
        return True

    def _record_dead_first(self, batch: _Batch) -> bool:
        """Record the batch's known dead letters before publishing; False if refused."""
        assert self.store is not None
        try:
            self.store.record_dead_letters(batch.dead, batch.gid)
        except OutboxError as exc:
            batch.unpublishable = exc
            return False
        batch.dead_recorded = len(batch.dead)
        self._dead_letters_failing = False
        return True

    def _record_evidence(self, batch: _Batch) -> None:
        """Wait for every confirm, store dead letters, send the ledger record."""
        store = self.store
        assert store is not None
        gid = batch.gid
        timeout = self.settings.publish_timeout
        if batch.unpublishable is not None:
            # Nothing was published (``_record_dead_first``): roll back and back off.
            self._roll_back(gid, reason=batch.unpublishable.message, accepted=0)
            raise batch.unpublishable
        deliveries = [
            d for pending in batch.sent for d in self.publisher.confirmed(pending, timeout)
        ]
        returned = [
            DeadLetter(row, d.reason)
            for row, d in zip(batch.good, deliveries, strict=False)
            if d.outcome in (Outcome.RETURNED, Outcome.REJECTED)
        ]
        failed = [d for d in deliveries if d.outcome in (Outcome.NACKED, Outcome.UNKNOWN)]
        if failed:
            for row, d in zip(batch.good, deliveries, strict=False):
                if d.sent and d.outcome is Outcome.UNKNOWN:
                    self.triage.suspects.refused(row.id, d.reason, alone=batch.isolated)
            # Sent without a confirm may be on the broker too: a possible duplicate.
            in_doubt = sum(
                1
                for d in deliveries
                if d.outcome is Outcome.ACCEPTED or (d.outcome is Outcome.UNKNOWN and d.sent)
            )
            self._roll_back(gid, reason=failed[0].reason, accepted=in_doubt)
            if not self.publisher.connected:
                raise BrokerUnavailable(f"lost RabbitMQ while publishing {gid}: {failed[0].reason}")
            if any("404" in d.reason for d in failed):
                self.triage.forget_exchanges()
            self.triage.learn(d.reason for d in failed)
            raise BrokerUnavailable(f"batch {gid} not confirmed: {failed[0].reason}")
        self._crash_point("after_publish")
        dead = batch.dead
        dead.extend(returned)
        batch.published = len(batch.good) - len(returned)
        if len(dead) > batch.dead_recorded:
            try:
                store.record_dead_letters(dead[batch.dead_recorded :], gid)
            except DeadLettersUnwritable as exc:
                # Known before publishing next time: the retry publishes nothing
                # until the dead letters can be written.
                self._dead_letters_failing = True
                for letter in returned:
                    self.triage.suspects.condemn(letter.row.id, letter.reason)
                self._roll_back(gid, reason=exc.message, accepted=batch.published)
                raise
            self._dead_letters_failing = False
        if dead:
            for letter in dead:
                emit(
                    log,
                    "row.dead_lettered",
                    logging.WARNING,
                    gid=gid,
                    message_id=letter.row.message_id,
                    reason=letter.reason,
                )
        if not self._may_commit():
            self._roll_back(
                gid, reason="heartbeat too old (partitioned?)", accepted=batch.published
            )
            raise DatabaseUnavailable("the relay's heartbeat is stale; backing off")
        record = ledger.record(gid, rows=len(batch.rows), dead=len(dead), relay_id=self.relay_id)
        record = dataclasses.replace(record, routing_key=self.settings.ledger_queue)
        batch.ledger = self.publisher.send([record])

    def _commit(self, batch: _Batch) -> None:
        """Wait for the ledger confirm (the evidence), then COMMIT PREPARED."""
        store = self.store
        assert store is not None and batch.ledger is not None
        gid = batch.gid
        [entry] = self.publisher.confirmed(batch.ledger, self.settings.publish_timeout)
        if entry.outcome is not Outcome.ACCEPTED:
            self._ledger_doubtful = True
            self._roll_back(
                gid, reason=f"ledger record not confirmed: {entry.reason}", accepted=batch.published
            )
            raise BrokerUnavailable(f"could not record {gid} in the ledger: {entry.reason}")
        self._crash_point("after_ledger")
        self._open[gid] = _Unsettled(
            gid, evidence=True, published=batch.published, dead=len(batch.dead)
        )
        self._crash_point("before_commit_prepared")
        store.finish(gid, commit=True)
        del self._open[gid]
        self.triage.suspects.clear(r.id for r in batch.rows)
        self.stats.batches_committed += 1
        self.stats.messages_published += batch.published
        self.stats.dead_letters += len(batch.dead)
        self.stats.batch_seconds.observe(time.monotonic() - batch.started)
        emit(
            log,
            "batch.committed",
            logging.DEBUG,
            gid=gid,
            rows=len(batch.rows),
            published=batch.published,
            dead=len(batch.dead),
            ms=f"{(time.monotonic() - batch.started) * 1000:.1f}",
        )
        if self._on_batch:
            self._on_batch(gid, self.stats)

    def _crash_point(self, point: str) -> None:
        """``OUTBOX_CRASH_AT``: when this point is armed, let the broker confirm what
        is in flight first (the other batch, when pipelined), so that the crash
        leaves an exact number of messages on the broker (tests only)."""
        if faults.armed(point):
            self.publisher.wait_for_confirms(self.settings.publish_timeout)
        faults.reached(point)

    def _probe_ledger(self) -> None:
        """Prove the ledger takes records again before publishing another batch.

        Without evidence a batch is rolled back, so while the ledger stream is
        unavailable every retry would publish a whole batch only to duplicate it.
        """
        probe = dataclasses.replace(ledger.probe(), routing_key=self.settings.ledger_queue)
        [entry] = self.publisher.publish([probe], self.settings.publish_timeout)
        if entry.outcome is not Outcome.ACCEPTED:
            raise BrokerUnavailable(
                f"the ledger {self.settings.ledger_queue!r} takes no records: {entry.reason}",
                "nothing is committed until it does; if the stream stays down after a broker "
                "crash, see README, 'Known limitations'",
            )
        self._ledger_doubtful = False

    def _may_commit(self) -> bool:
        """False once our heartbeat is so old a resolver may presume us dead.

        The heartbeat has its own thread and session (``outbox.liveness``), so only
        a control session that cannot reach the server makes it old, never a slow
        statement of this loop.
        """
        if self.liveness is None or self.liveness.lost:
            return False
        return self.liveness.age < self.settings.relay_timeout - self.settings.heartbeat_interval

    def _roll_back(self, gid: str, *, reason: str, accepted: int) -> None:
        assert self.store is not None
        self.store.finish(gid, commit=False)
        self._open.pop(gid, None)
        self.stats.batches_rolled_back += 1
        self.stats.duplicates_possible += accepted
        emit(
            log,
            "batch.rolled_back",
            logging.WARNING,
            gid=gid,
            reason=reason,
            accepted_before=accepted,
        )

    def _settle(self) -> None:
        """Finish the batches whose PREPARE/COMMIT/ROLLBACK outcome was cut off."""
        assert self.store is not None
        while self._unsettled:
            unsettled = self._unsettled[0]
            if self.store.gid_exists(unsettled.gid):
                self.store.finish(unsettled.gid, commit=unsettled.evidence)
                outcome = "committed" if unsettled.evidence else "rolled_back"
            else:
                outcome = "finished_elsewhere"
            if unsettled.evidence:
                self.stats.batches_committed += 1
                self.stats.messages_published += unsettled.published
                self.stats.dead_letters += unsettled.dead
            else:
                self.stats.batches_rolled_back += 1
            emit(log, "batch.settled", logging.WARNING, gid=unsettled.gid, outcome=outcome)
            self._unsettled.pop(0)
