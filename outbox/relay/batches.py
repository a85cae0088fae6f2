"""One batch's life: claim → PREPARE → publish → record → COMMIT PREPARED.

State machine of one batch (``gid`` = ``obx:<table>:<relay_id>:<seq>``)::

    claim ──PREPARE──▶ PREPARED ──send──▶ SENT ──confirms, dead letters──▶ RECORDING
      │ (0 rows)          │                 │                                  │ ledger
      ▼                   │                 │                                  ▼ record sent
    nothing               │                 │                              RECORDED
                          │                 │                                  │ ledger
                          │                 │                                  ▼ confirmed
                          │                 │                              EVIDENCED
                          │                 │                                  │
                          ▼                 ▼                                  ▼
                  ROLLBACK PREPARED on any failure                     COMMIT PREPARED
                  (rows claimable again)

    any open state ──failure──▶ IN_DOUBT ──reconnected, lost ──▶ gid present: finish it by
                                           session ended          its evidence; gone:
                                                                  finished elsewhere

    SENT / RECORDED ──database lost──▶ kept ──relay id taken back──▶ finished as above
                                            (the hand-over, below)

Every batch a relay has prepared and not finished is one entry of one table,
``Batches.in_flight``, with its ``State``.  ``IN_DOUBT`` is a batch whose
PREPARE, COMMIT PREPARED or ROLLBACK PREPARED was cut off, or that a failure left
unfinished: it is settled after reconnecting by looking its gid up (present →
COMMIT if the ledger confirmed its record, else ROLLBACK; gone → someone finished
it).  The lookup waits until the lost session's backend is gone: a client cut off
does not stop its backend, which may still be running the PREPARE or COMMIT
PREPARED whose reply was lost (``Relay._end_predecessors`` ends it first), and a gid
another session holds (55000, busy) stays in doubt and is looked up again.
Nothing is published for a batch whose PREPARE is not known to have succeeded.

``depth`` is how many batches may be in flight between PREPARE and COMMIT
PREPARED: 1 (``--no-pipeline``) or 2 (``--pipeline``, the default).  One
schedule serves both (``step``)::

    1. finish the batch kept from a failure it survived, if any;
    2. claim and PREPARE batch N+1 (depth 2: while the broker persists N);
    3. wait for N's confirms, record its dead letters, send its ledger record;
    4. publish N+1;
    5. wait for N's ledger confirm, COMMIT PREPARED N;
    6. depth 1: N+1 goes through 3 and 5 at once (it is the only batch).

If N's confirms have all arrived when the step starts (taken without waiting:
``BrokerPort.collect_confirms``), 3 runs before 2.  A message's latency is the
path from the claim to its publishing, and 3 then no longer sits on it; N's
ledger record also goes out earlier, so 5 waits less, and a crash during 2
finds N with its evidence sent (crash table: "ledger record sent"; committed
once the ledger has it, no duplicate).  Under a backlog N's confirms are usually still
due at that point, and 2 overlaps them as before.

If they are still due after 2, 4 runs before 3 (``_sends_early``): N+1 is
published beside N, so the broker persists both and is not left idle between N's
last confirm and N+1's publishing (the relay waited there for the broker, and the
broker for the relay: four relays draining a backlog left a fifth of two cores idle;
``docs/benchmarks.md``).  Still two batches in flight, no more.  Not when N+1
follows N (below), holds a suspect row (sent alone, waiting for its confirm) or
must write dead letters first, nor after a failure until a batch is committed again.

When N+1 holds the next rows of ordering keys that N holds (it ``follows`` N:
the claim may take them, ``BatchStore.claim_batch(own=…)``), 4 and 5 swap: N+1 is
published only after N is committed, so no row goes out while an earlier row of
its key is still in the outbox (``outbox.relay.ordering``), and if N fails, N+1, never
published, is rolled back with it.

Each batch still goes claim → PREPARE → publish → confirms → ledger → COMMIT
PREPARED in that order, and N+1 is published only after its own PREPARE
succeeded (and, when it follows N, after N is committed).

One failure path (``fail``): a failure (database or broker lost, no confirm, a
nack, a refusal, no prepared-transaction slot) makes every open batch
``IN_DOUBT``, except a batch already published (``SENT`` or ``RECORDED``) when the
failure cannot have touched its confirms (a database failure, a resource alarm,
the other batch nacked on a live connection: ``survives_failure``); such a batch
(or both) stays in flight, ``kept``, and is finished first on the next step.  A step
that must give a batch up rolls it back at once (``_give_up``) and raises.

What a crash (kill -9) leaves at each step, and who cleans up:

=============================  ===============================  ==================================
crash right after              state left                       outcome (by whom)
=============================  ===============================  ==================================
claim (before PREPARE)         open transaction, dies with the  rows free at once; no duplicate
                               session
PREPARE                        prepared xact holding the rows   no evidence → ROLLBACK (resolver);
                                                                no duplicate
messages sent, not confirmed   none to all of the batch on the  no evidence → ROLLBACK (resolver);
                               broker                           duplicates ≤ batch
all messages confirmed         every message on the broker      no evidence → ROLLBACK (resolver);
                                                                duplicates = batch (tiny window)
ledger record sent             evidence on the broker, or soon  in the ledger → COMMIT; not →
                                                                ROLLBACK, duplicates = batch
ledger record confirmed        evidence on the broker           COMMIT (resolver); no duplicate
COMMIT PREPARED sent           unknown to the relay             gid gone → done; present → COMMIT
going dormant or waking        no batch (dormant only with none a registry row whose lock is gone
(``outbox.relay.process``)     in flight); the front saved or   (forgotten by resolvers); no
                               not                              duplicate, no row held
=============================  ===============================  ==================================

At depth 2 the crash also finds the other batch in flight at its own step of
the table: N+1 is at most "messages sent, not confirmed" until N is committed,
and at most "PREPARE" until N's ledger record is sent if N's confirms were in by
N+1's claim (``collect_confirms``, above); if they were not, N+1 went out beside
N, and a crash before N's ledger record rolls both back.  So a crash leaves at
most two batches to resolve, and duplicates per crash are ≤ batch_size at depth 1,
≤ 2 x batch_size at depth 2.

The crash points of ``outbox/fault_injection.py`` (``OUTBOX_CRASH_AT``) only
observe this schedule: armed or not, the relay awaits exactly the confirms it
awaits in production, so how much of an unconfirmed send reached the broker is
the broker's business, as after a real kill -9.
``tests/integration/relay/test_faults_crash.py`` learns it from the evidence (the
ledger, the queue) and asserts the bounds above; ``mid_publish`` is "messages
sent, not confirmed": reached once a send (the batch, or an ordering wave of it)
is written to the socket, before any of its confirms is taken.  There is no
point between two messages of one send: ``Publisher.send`` writes a batch in as
few writes as it can (``FLUSH_BYTES``), and splitting it around a point would
run a schedule production never runs; the kill after the send already leaves
anything from none to all of it on the broker (the kernel may still deliver the
socket's tail, or reset the connection and drop it).

A database outage costs no batch while the relay process survives it, at either
depth (the hand-over, below).  "resolver" is any relay's periodic pass or ``outbox
resolve`` (``resolver/decide.py``).

The hand-over.  A restart, crash or failover of PostgreSQL ends the relay's control
session, and its relay id's lock with it, but not its prepared batches, and the
broker connection still brings their confirms.  After reconnecting, the relay
takes the same relay id back (``Relay._register``, ``Liveness.resume``) under the
id's hand-over lock (``outbox.gid.HANDOVER_LOCK_CLASS``), which a resolver holds
for its whole pass over a dead id's batches; resolvers wait for a relay whose last
heartbeat predates the server's start or promotion, ``relay_timeout`` from then
("reconnecting").  Then each batch in flight is finished as if nothing happened:
published ones (``kept``) by their confirms, ledger record and COMMIT PREPARED; ones
in doubt by looking their gid up (``settle``); ones whose gid is gone were finished
by a resolver that held the id before (``resumed``).  A control session lost while
a batch waits for its confirms does not stop its ledger record (``Relay._may_commit``
looks at the heartbeat's age only): the record is safe whoever finishes the batch.

=====================================  ==========================================
crash or race during the hand-over     outcome
=====================================  ==========================================
server gone, relay waiting for N's     N kept; after reconnecting: N's record,
confirms (N+1 out beside it)           COMMIT PREPARED; N+1 likewise; no duplicate
server gone during N's COMMIT          N in doubt with evidence: looked up, COMMIT
PREPARED
server gone during N+1's PREPARE       N+1 in doubt, never published: looked up,
                                       ROLLBACK (no duplicate); N kept
relay reconnects before the resolvers  takes its id back; a resolver sees it alive
a resolver took the id first (the      the relay retries; the batches the
relay came back after relay_timeout,   resolver finished are gone (committed from
or its control session died alone)     the ledger, or rolled back: the crash
                                       table's rows for a relay killed there)
relay cannot take its id back within   draws a new id and settles its batches by
relay_timeout                          what it knows (as every relay did before)
relay killed while taking it back      its batches are a dead relay's: as above
resolver killed holding the id         its session's end lets the lock go; the
                                       relay takes the id back, looks gids up
=====================================  ==========================================

Where the relay itself dies, the crash table above holds unchanged; a relay killed
together with the server (or just before it) has its batches finished
``relay_timeout`` after the server's return instead of at once.

A write that keeps failing (whatever the error: a lock, a timeout, a refused
value, a cut connection) must not make every retry publish a batch again.  Each
write's retry, and what a failure lasting any length of time costs:

=================  ==============================================  =====================
failing write      what the retries do                             duplicates, in all
=================  ==============================================  =====================
claim              nothing new is claimed, so nothing published;   0
                   a batch published before (depth 2) survives
                   the failure and is committed first
prepare            the claim ends with the failed PREPARE;         0
                   nothing of it was published
dead_letters       the batch is rolled back once; its dead         its accepted
                   letters are remembered (``_unwritten``), and    messages, once
                   until they are written every batch writes the
                   dead letters it knows *before* publishing: a
                   batch whose dead letters cannot be written
                   publishes nothing
ledger             the batches in flight are rolled back once;     the batches in
                   the ledger is probed before every claim:        flight, once
                   nothing is published until a record is
                   confirmed
commit_prepared    in doubt: looked up and committed from its      0
                   evidence before anything else runs (``settle``)
rollback_prepared  in doubt: looked up and rolled back before      0 more
                   anything else runs
=================  ==============================================  =====================

So a failing write costs at most the batches in flight, once (≤ batch_size at
depth 1, ≤ 2 x batch_size at depth 2), and no row goes out more than twice,
however long the failure lasts.  (One case costs a batch more: a row first
returned as unroutable while the dead-letter write is still failing, in a batch
that held no dead letter known before; its batch is then held like the first.)
Every failure is counted by write (``Stats.write_failures``, the metric
``outbox_write_failures_total{write}``) and named in the retry's log line
(``relay.retry write=…``); the relay's backoff grows until a batch is committed
again (``process``), whichever write failed.

Where the claims start: the work session's low-water mark and late rows
(``BatchStore.front``, ``outbox.db.front``), so a claim does not re-read the dead
rows a held MVCC horizon keeps.  No step above has to move it: a batch rolled back
(by the relay, a resolver, or the end of a claim session before PREPARE) was
visible to every claim all along, so no mark passed its rows; a new work session
(after any reconnect) starts from the lowest id again.

Transient failures roll the batch back and retry with backoff; they never
dead-letter a row.  Rows that can never be published (``triage.Triage``) and
unroutable returns become dead letters in the same pass.

The batch talks to the database and the broker only through the two ports below
(``BatchStorePort``, ``BrokerPort``): ``outbox.db.batches.BatchStore`` and
``outbox.amqp.publisher.Publisher`` in production, in-memory fakes in
``tests/unit/relay/test_batches.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn, Protocol

from outbox import fault_injection as faults
from outbox.amqp import ledger
from outbox.amqp.confirms import Delivery, Outcome, Pending
from outbox.amqp.frames import Message
from outbox.config import Settings
from outbox.errors import (
    BatchNotConfirmed,
    BrokerBlocked,
    BrokerUnavailable,
    DatabaseRefused,
    DatabaseUnavailable,
    MissingPrivileges,
    OutboxError,
    OutcomeUnknown,
    PreparedSlotsExhausted,
)
from outbox.events import emit
from outbox.gid import Gid
from outbox.message import ORDERING_KEY_HEADER, DeadLetter, OutboxRow
from outbox.relay import ordering
from outbox.relay.isolation import SUSPECT_TTL_SECONDS
from outbox.relay.stats import Stats
from outbox.relay.triage import Triage

log = logging.getLogger("outbox.relay")

# A claim is an index scan of at most batch_size rows: milliseconds.  Slower means a
# bad plan, a bloated table or an overloaded server: say so in the log.
SLOW_CLAIM_SECONDS = 1.0

# How long a row whose dead letter could not be written is remembered without being
# seen again (each failing retry refreshes it): as long as a verdict learnt from the
# broker (``isolation.SUSPECT_TTL_SECONDS``).
UNWRITTEN_SECONDS = SUSPECT_TTL_SECONDS

# What makes a step fail and the relay back off (everything else is a bug).
RETRYABLE: tuple[type[OutboxError], ...] = (
    DatabaseUnavailable,
    BrokerUnavailable,
    OutcomeUnknown,
    PreparedSlotsExhausted,
    MissingPrivileges,  # revoked while running: back off until granted
    DatabaseRefused,  # a constraint or trigger someone added: back off until removed
)


class BatchStorePort(Protocol):
    """What a batch needs from PostgreSQL (``outbox.db.batches.BatchStore``)."""

    def claim_batch(
        self,
        limit: int,
        max_bytes: int = ...,
        *,
        hold_keys: bool = ...,
        own: Sequence[int] = ...,
    ) -> list[OutboxRow]: ...
    def abandon_claim(self) -> None: ...
    def prepare(self, gid: str) -> None: ...
    def finish(self, gid: str, *, commit: bool) -> bool: ...
    def gid_exists(self, gid: str) -> bool: ...
    def record_dead_letters(self, dead: Sequence[DeadLetter], gid: str) -> None: ...


class BrokerPort(Protocol):
    """What a batch needs from RabbitMQ (``outbox.amqp.publisher.Publisher``)."""

    @property
    def connected(self) -> bool: ...
    @property
    def blocked(self) -> bool: ...
    def send(self, messages: Sequence[Message]) -> Pending: ...
    def confirmed(self, pending: Pending, timeout: float) -> list[Delivery]: ...
    def publish(self, messages: Sequence[Message], timeout: float) -> list[Delivery]: ...
    def wait_for_confirms(self, timeout: float) -> bool: ...
    def collect_confirms(self) -> None: ...
    def exchange_exists(self, name: str) -> bool: ...


class State(enum.Enum):
    PREPARED = "prepared"  # PREPARE succeeded; nothing published
    SENT = "sent"  # messages handed to the broker; confirms may still be due
    RECORDING = "recording"  # confirms being checked, dead letters being written
    RECORDED = "recorded"  # ledger record sent; its confirm is the evidence
    EVIDENCED = "evidenced"  # the ledger confirmed the record: COMMIT PREPARED is due
    IN_DOUBT = "in_doubt"  # cut off or given up: settled by looking the gid up


# A published batch whose confirms or ledger confirm are still due: what the next
# step finishes, and what survives a database failure (``survives_failure``).
_WAITING = (State.SENT, State.RECORDED)


@dataclasses.dataclass(eq=False)
class Batch:
    gid: str
    rows: Sequence[OutboxRow]
    started: float
    state: State = State.PREPARED
    good: list[OutboxRow] = dataclasses.field(default_factory=list)
    dead: list[DeadLetter] = dataclasses.field(default_factory=list)
    sent: list[Pending] = dataclasses.field(default_factory=list)
    ledger: Pending | None = None
    published: int = 0
    evidence: bool = False  # the ledger confirmed the record: commit, never roll back
    kept: bool = False  # published before a failure it survived: finish it first
    dead_recorded: int = 0  # dead letters already stored (``_record_dead_first``)
    isolated: bool = False  # a suspect published alone was refused
    # Holds later rows of keys the batch before it holds: published after that one
    # is committed, holding back rows behind its dead letters (``first_dead``).
    follows: bool = False
    first_dead: dict[str, int] = dataclasses.field(default_factory=dict)
    unpublishable: OutboxError | None = None  # nothing may be published: roll back


def survives_failure(error: OutboxError) -> bool:
    """Whether a batch already published is still finished by its relay after ``error``.

    Its PREPARE succeeded, so the batch is durable and any session of the relay may
    finish it; while the broker connection lives, its confirms still arrive.  A
    database failure (lost work connection, PREPARE of the next batch cut off or
    refused for want of slots) therefore need not cost a batch of duplicates: the
    batch is finished after reconnecting, provided the control session (and with
    it the relay id that keeps resolvers away) survived, or the relay took the id
    back (the hand-over, module docstring).  A broker failure puts
    its confirms in doubt: it is rolled back.  Except a resource alarm
    (``BrokerBlocked``, raised before the next claim): the connection lives, and
    what the broker read before it blocked is still confirmed, the batch's ledger
    record too if it went out (``Batches.step``: early).  The batch is kept and
    finished first once the relay retries; if its confirms do not come within
    ``publish_timeout``, it is rolled back then, as before.  Likewise after the
    other batch was nacked on a live connection (``BatchNotConfirmed``; the
    publisher takes this one's confirms before it abandons the channel): that one
    is rolled back, this one, published early beside it, is finished by its own
    confirms.  A confirm timeout puts every message out on the channel in doubt:
    both are rolled back.
    """
    return isinstance(error, (BrokerBlocked, BatchNotConfirmed)) or not isinstance(
        error, BrokerUnavailable
    )


def _sent(batch: Batch) -> int:
    """Messages of ``batch`` written to the broker (confirmed or not)."""
    return sum(1 for pending in batch.sent for d in pending.deliveries if d.sent)


def to_message(row: OutboxRow) -> Message:
    headers = row.headers
    if row.ordering_key is not None:
        headers = {**(headers or {}), ORDERING_KEY_HEADER: row.ordering_key}
    return Message(  # by position: one per row, and keywords cost as much again
        row.exchange,
        row.routing_key,
        row.payload,
        str(row.message_id),
        row.content_type,
        headers,
        row.created_at,
    )


def sort_out(
    triage: Triage, broker: BrokerPort, rows: Sequence[OutboxRow]
) -> tuple[list[DeadLetter], list[OutboxRow]]:
    """Triage a batch: ask the broker about the exchanges triage cannot vouch for,
    then split the rows into dead letters and publishable rows."""
    unknown = triage.exchanges_to_check({r.exchange for r in rows})
    missing = {name for name in unknown if not broker.exchange_exists(name)}
    triage.exchanges_found(unknown - missing)
    return triage.sort_out(rows, missing)


class Batches:
    """The batches of one relay between claim and COMMIT PREPARED."""

    def __init__(
        self,
        settings: Settings,
        broker: BrokerPort,
        stats: Stats,
        *,
        may_commit: Callable[[], bool],
        on_batch: Callable[[str, Stats], None] | None = None,
    ) -> None:
        self.settings = settings
        self.depth = 2 if settings.pipeline else 1
        self.broker = broker
        self.stats = stats
        self.triage = Triage(settings.max_message_bytes)
        self.store: BatchStorePort | None = None  # the relay's current work connection
        self.relay_id = ""  # the relay's current id (a new one after a lost control session)
        self.in_flight: dict[str, Batch] = {}  # by gid, in claim order
        self.ledger_doubtful = False  # probe the ledger before the next batch
        # Publish the next batch before the previous one's confirms are in ("the
        # schedule", 3 after 4): only while nothing has failed since the last commit.
        self._early = True
        self._may_commit = may_commit
        self._on_batch = on_batch
        self._seq = 0
        # Rows the last ``step`` claimed (0: it claimed nothing, whatever it committed).
        self.claimed = 0
        # Rows whose dead letter could not be written (row id → reason, when last
        # refused): while any is left, a batch writes the dead letters it knows
        # before publishing.
        # Each retry refreshes an entry; one left alone for ``UNWRITTEN_SECONDS`` (its
        # row relayed by another relay meanwhile, say) is forgotten.
        self._unwritten: dict[int, tuple[str, float]] = {}

    # -- the schedule ------------------------------------------------------------
    def step(self) -> int:
        """One step of the loop (module docstring, "the schedule"); returns the rows
        it moved on: claimed, or else committed.  0: there was nothing to do (the
        relay waits for work).

        A step that claims nothing may still commit the batch kept from the step
        before: that frees the next rows of its ordering keys, and the rows a claim
        cut short by the byte budget kept locked.  That is progress, and the loop
        claims again at once instead of waiting for a wake-up."""
        self.claimed = 0
        try:
            finished = 0
            for survivor in [b for b in self.in_flight.values() if b.kept and b.state in _WAITING]:
                # Published before a failure that it survived: finish it before
                # preparing another (which may be what failed, e.g. no slot).
                self._finish(survivor)
                finished += len(survivor.rows)
            kept = self._waiting()
            if kept is not None and self._confirms_in(kept):
                # Its evidence goes out before the claim, not between the next
                # batch's PREPARE and its publishing: that path is every message's
                # latency, and the ledger record is then confirmed sooner too.
                self._record(kept)
            batch = self._claim_and_prepare(kept)
            early = kept is not None and kept.state is State.SENT and self._sends_early(batch)
            if early:
                # The broker persists both while N's confirms come in: it is never
                # left without a batch of this relay between N's last confirm and
                # N+1's publishing (the schedule: 4 before 3).
                assert batch is not None
                self._send(batch)
            if kept is not None and kept.state is State.SENT:
                self._record(kept)
            if batch is not None and kept is not None and batch.follows:
                # Rows of keys that ``kept`` holds: published only once it is committed.
                self._commit(kept)
                finished += len(kept.rows)
                batch.first_dead = ordering.blockers(kept.dead)
                kept = None
            if batch is not None and not early:
                self._send(batch)
            if kept is not None:
                self._commit(kept)
                finished += len(kept.rows)
            if batch is not None and (self.depth == 1 or batch.unpublishable is not None):
                self._finish(batch)  # unpublishable: nothing was sent; roll back, back off
            self.claimed = len(batch.rows) if batch else 0
            return len(batch.rows) if batch else finished
        except RETRYABLE as exc:
            self.fail(exc)
            raise

    def _sends_early(self, batch: Batch | None) -> bool:
        """Whether ``batch`` may be published while the batch before it still waits
        for its confirms: not when it follows that batch (its keys' rows wait for
        its commit), nor when publishing it could fail or wait for a confirm of its
        own (no dead letter left unwritten, no suspect row sent alone), nor after a
        failure until a batch is committed again (a retry costs what it cost
        before: the early batch is never what a failure puts in doubt twice)."""
        return (
            batch is not None
            and self._early
            and not batch.follows
            and batch.unpublishable is None
            and not self._unwritten
            and self.triage.suspects.empty
        )

    def finish_in_flight(self) -> None:
        """Stopping: finish the batches published (their confirms and evidence), claim
        no more, settle the rest.

        Without a database session (it was lost and could not be opened again) none
        can be finished or looked up: they are left in doubt to the resolvers, whose
        relay id ends with this process, and the log says how many."""
        if self.store is None:
            self.fail(None)
            if self.in_flight:
                emit(
                    log,
                    "relay.stopped_with_batches_in_doubt",
                    logging.WARNING,
                    batches=len(self.in_flight),
                    gids=",".join(self.in_flight),
                    hint="no database session: a resolver (any relay, or outbox resolve) "
                    "finishes them",
                )
            return
        try:
            for waiting in [b for b in self.in_flight.values() if b.state in _WAITING]:
                self._finish(waiting)
        finally:
            self.fail(None)
            self.settle()

    def _waiting(self) -> Batch | None:
        """The batch published by the previous step, waiting for its evidence (its
        ledger record perhaps already sent, if a database failure came after)."""
        return next((b for b in self.in_flight.values() if b.state in _WAITING), None)

    def _confirms_in(self, batch: Batch) -> bool:
        """Whether every confirm of ``batch`` has arrived (taking those the broker
        has sent so far, without waiting)."""
        self.broker.collect_confirms()
        return all(pending.settled for pending in batch.sent)

    def _finish(self, batch: Batch) -> None:
        if batch.state is State.SENT:
            self._record(batch)
        self._commit(batch)

    # -- one batch, in order -------------------------------------------------------
    def _claim_and_prepare(self, waiting: Batch | None = None) -> Batch | None:
        """Claim rows and PREPARE them (crash table: "claim", "PREPARE").

        The claim may take the next rows of keys that ``waiting`` (the batch published
        by the previous step) holds; the new batch then ``follows`` it.
        """
        store = self._store()
        started = time.monotonic()
        if self.broker.blocked:
            # Publishing into a blocked connection only queues messages that a
            # timeout would then put in doubt: claim nothing until the alarm clears.
            raise BrokerBlocked("RabbitMQ is blocking publishers (resource alarm)")
        if self.ledger_doubtful:
            self._probe_ledger()
        claim_started = time.monotonic()
        held = [r for r in waiting.rows if r.ordering_key is not None] if waiting else []
        with self._writing("claim"):
            rows = store.claim_batch(
                self.settings.batch_size,
                self.settings.batch_max_bytes,
                hold_keys=self.settings.hold_keys,
                own=[r.id for r in held],
            )
            self._observe_claim(time.monotonic() - claim_started, len(rows))
            if not rows:
                store.abandon_claim()
                return None
        faults.reached("after_claim")
        self._seq += 1
        batch = Batch(str(Gid(self.settings.table, self.relay_id, self._seq)), rows, started)
        held_keys = {r.ordering_key for r in held}
        batch.follows = bool(held_keys) and any(r.ordering_key in held_keys for r in rows)
        try:
            with self._writing("prepare"):
                store.prepare(batch.gid)
        except OutcomeUnknown:
            batch.state = State.IN_DOUBT
            self.in_flight[batch.gid] = batch
            raise
        # From here on the batch is durable and undecided until finished.
        self.in_flight[batch.gid] = batch
        faults.reached("after_prepare")
        return batch

    def _send(self, batch: Batch) -> None:
        """Publish the batch's messages without waiting ("messages sent, not confirmed").

        Suspects go first, one at a time (``_send_alone``).  While some dead letters
        could not be written (``_unwritten``, whatever the error), the dead letters
        known before publishing are recorded first, and nothing is published if
        that fails: a dead-letter write that keeps failing costs no further
        duplicates.
        """
        try:
            self._publish(batch)
        finally:
            batch.state = State.SENT

    def _publish(self, batch: Batch) -> None:
        batch.dead, good = sort_out(self.triage, self.broker, batch.rows)
        if self._unwritten:
            self._forget_old_unwritten()
        if self._unwritten:
            # Known dead letters from a write that failed, whatever triage says now.
            batch.dead += [
                DeadLetter(r, self._unwritten[r.id][0]) for r in good if r.id in self._unwritten
            ]
            good = [r for r in good if r.id not in self._unwritten]
        if self.settings.hold_keys:
            first_dead = {**ordering.blockers(batch.dead), **batch.first_dead}
            held, good = ordering.hold(good, first_dead)
            batch.dead += held
        if self._unwritten and batch.dead and not self._record_dead_first(batch):
            return
        waves = ordering.waves(good)
        first_returned: dict[str, int] = {}
        for number, wave in enumerate(waves):
            if first_returned and self.settings.hold_keys:
                held, wave = ordering.hold(wave, first_returned)
                batch.dead += held
            sent, before = len(batch.sent), len(batch.good)
            if not self._send_wave(batch, wave):
                return
            if number == len(waves) - 1:
                break
            # The next wave holds later rows of these keys: only once these are in.
            timeout = self.settings.publish_timeout
            confirmed = [d for p in batch.sent[sent:] for d in self.broker.confirmed(p, timeout)]
            deliveries = list(zip(batch.good[before:], confirmed, strict=True))
            if any(d.outcome in (Outcome.NACKED, Outcome.UNKNOWN) for _, d in deliveries):
                return  # ``_record`` rolls the batch back; later waves never go out
            returned = [
                DeadLetter(row, d.reason)
                for row, d in deliveries
                if d.outcome in (Outcome.RETURNED, Outcome.REJECTED)
            ]
            for key, first in ordering.blockers(returned).items():
                first_returned.setdefault(key, first)

    def _send_wave(self, batch: Batch, rows: Sequence[OutboxRow]) -> bool:
        """Publish rows of which no two share a key; suspects first, alone.  False
        when a suspect was refused (nothing more may go out)."""
        suspects, others = self.triage.isolate(rows)
        batch.good += suspects
        if suspects and not self._send_alone(batch, suspects):
            return False
        batch.good += others
        if others:
            batch.sent.append(self.broker.send([to_message(r) for r in others]))
            # Written to the socket, no confirm taken: how much of it the broker
            # has is up to the broker (crash table: "messages sent, not confirmed").
            faults.reached("mid_publish")
        return True

    def _send_alone(self, batch: Batch, suspects: Sequence[OutboxRow]) -> bool:
        """Publish each suspect alone, waiting for its confirm; False at the first
        failure, which then names its row (``isolation.Suspects``)."""
        timeout = self.settings.publish_timeout
        # Nothing else may be in flight when a refusal closes the channel.
        self.broker.wait_for_confirms(timeout)
        for row in suspects:
            pending = self.broker.send([to_message(row)])
            batch.sent.append(pending)
            [delivery] = self.broker.confirmed(pending, timeout)
            if delivery.outcome in (Outcome.NACKED, Outcome.UNKNOWN):
                batch.isolated = True
                return False
            self.triage.suspects.clear([row.id])
        return True

    def _record_dead_first(self, batch: Batch) -> bool:
        """Record the batch's known dead letters before publishing; False if refused
        (nothing of the batch is then published: it is rolled back)."""
        try:
            self._write_dead_letters(batch, batch.dead)
        except RETRYABLE as exc:
            batch.unpublishable = exc
            return False
        batch.dead_recorded = len(batch.dead)
        return True

    def _write_dead_letters(self, batch: Batch, letters: Sequence[DeadLetter]) -> None:
        """Record ``letters``; remember them as unwritten if that fails, whatever
        the error, so that no later attempt publishes before writing them."""
        try:
            with self._writing("dead_letters"):
                self._store().record_dead_letters(letters, batch.gid)
        except RETRYABLE:
            for letter in letters:
                self._unwritten[letter.row.id] = (letter.reason, time.monotonic())
            raise
        for letter in letters:
            self._unwritten.pop(letter.row.id, None)

    def _record(self, batch: Batch) -> None:
        """Wait for every confirm, store dead letters, send the ledger record."""
        batch.state = State.RECORDING
        if batch.unpublishable is not None:
            # Nothing was published (``_record_dead_first``): roll back and back off.
            self._give_up(batch, batch.unpublishable, accepted=0)
        timeout = self.settings.publish_timeout
        deliveries = [d for pending in batch.sent for d in self.broker.confirmed(pending, timeout)]
        returned = [
            DeadLetter(row, d.reason)
            for row, d in zip(batch.good, deliveries, strict=False)
            if d.outcome in (Outcome.RETURNED, Outcome.REJECTED)
        ]
        failed = [d for d in deliveries if d.outcome in (Outcome.NACKED, Outcome.UNKNOWN)]
        if failed:
            self._not_confirmed(batch, deliveries, failed)
        faults.reached("after_publish")
        batch.dead.extend(returned)
        batch.published = len(batch.good) - len(returned)
        self._store_dead_letters(batch, returned)
        if not self._may_commit():
            self._give_up(
                batch,
                DatabaseUnavailable("the relay's heartbeat is stale; backing off"),
                accepted=batch.published,
                reason="heartbeat too old (partitioned?)",
            )
        record = ledger.record(
            batch.gid,
            queue=self.settings.ledger_queue,
            rows=len(batch.rows),
            dead=len(batch.dead),
            relay_id=self.relay_id,
        )
        with self._writing("ledger"):
            batch.ledger = self.broker.send([record])
        batch.state = State.RECORDED

    def _not_confirmed(
        self, batch: Batch, deliveries: Sequence[Delivery], failed: Sequence[Delivery]
    ) -> NoReturn:
        """Some messages were nacked or are in doubt: learn what we can, roll back."""
        for row, d in zip(batch.good, deliveries, strict=False):
            if d.sent and d.outcome is Outcome.UNKNOWN:
                self.triage.suspects.refused(row.id, d.reason, alone=batch.isolated)
        # Sent without a confirm may be on the broker too: a possible duplicate.
        in_doubt = sum(
            1
            for d in deliveries
            if d.outcome is Outcome.ACCEPTED or (d.outcome is Outcome.UNKNOWN and d.sent)
        )
        reason = failed[0].reason
        if not self.broker.connected:
            error = BrokerUnavailable(f"lost RabbitMQ while publishing {batch.gid}: {reason}")
        else:
            if any("404" in d.reason for d in failed):
                self.triage.forget_exchanges()
            self.triage.learn(d.reason for d in failed)
            # Nacked on a live connection: the other batch's confirms still came
            # (``Publisher.confirmed``).  A timeout put them in doubt with these.
            kind = (
                BatchNotConfirmed
                if all(d.outcome is Outcome.NACKED for d in failed)
                else BrokerUnavailable
            )
            error = kind(f"batch {batch.gid} not confirmed: {reason}")
        self._give_up(batch, error, accepted=in_doubt, reason=reason)

    def _store_dead_letters(self, batch: Batch, returned: Sequence[DeadLetter]) -> None:
        if len(batch.dead) > batch.dead_recorded:
            try:
                self._write_dead_letters(batch, batch.dead[batch.dead_recorded :])
            except RETRYABLE as exc:
                # Known before publishing next time (``_unwritten``): the retry
                # publishes nothing of this batch until its dead letters are written.
                for letter in returned:
                    self.triage.suspects.condemn(letter.row.id, letter.reason)
                self._give_up(batch, exc, accepted=batch.published)
        for letter in batch.dead:
            emit(
                log,
                "row.dead_lettered",
                logging.WARNING,
                gid=batch.gid,
                message_id=letter.row.message_id,
                reason=letter.reason,
            )

    def _commit(self, batch: Batch) -> None:
        """Wait for the ledger confirm (the evidence), then COMMIT PREPARED."""
        assert batch.ledger is not None
        [entry] = self.broker.confirmed(batch.ledger, self.settings.publish_timeout)
        if entry.outcome is not Outcome.ACCEPTED:
            self.ledger_doubtful = True
            self._give_up(
                batch,
                self._failed(
                    "ledger",
                    BrokerUnavailable(
                        f"could not record {batch.gid} in the ledger: {entry.reason}"
                    ),
                ),
                accepted=batch.published,
                reason=f"ledger record not confirmed: {entry.reason}",
            )
        faults.reached("after_ledger")
        batch.state, batch.evidence = State.EVIDENCED, True
        faults.reached("before_commit_prepared")
        with self._writing("commit_prepared"):
            done = self._store().finish(batch.gid, commit=True)
        del self.in_flight[batch.gid]
        if not done:
            # A resolver finished it while the relay's control session was lost with
            # the server up (the hand-over's last line): from this record, or
            # rolled back before it was written.
            emit(log, "batch.settled", logging.WARNING, gid=batch.gid, outcome="finished_elsewhere")
            return
        self.triage.suspects.clear(r.id for r in batch.rows)
        self._early = True
        self._count_committed(batch)
        self.stats.batch_seconds.observe(time.monotonic() - batch.started)
        emit(
            log,
            "batch.committed",
            logging.DEBUG,
            gid=batch.gid,
            rows=len(batch.rows),
            published=batch.published,
            dead=len(batch.dead),
            ms=f"{(time.monotonic() - batch.started) * 1000:.1f}",
        )
        if self._on_batch:
            self._on_batch(batch.gid, self.stats)

    # -- failure -----------------------------------------------------------------------
    def _give_up(
        self, batch: Batch, error: OutboxError, *, accepted: int, reason: str | None = None
    ) -> NoReturn:
        """ROLLBACK PREPARED now (the rows are claimable again), then fail the step."""
        with self._writing("rollback_prepared"):
            self._store().finish(batch.gid, commit=False)
        self.in_flight.pop(batch.gid, None)
        self.stats.batches_rolled_back += 1
        self.stats.duplicates_possible += accepted
        emit(
            log,
            "batch.rolled_back",
            logging.WARNING,
            gid=batch.gid,
            reason=reason or error.message,
            accepted_before=accepted,
        )
        raise error

    def fail(self, error: OutboxError | None) -> None:
        """After ``error`` (None: stopping, or the relay id was lost), every open batch
        is in doubt, except a published one that survives it, which stays in flight."""
        self._early = False
        for batch in self.in_flight.values():
            if batch.state is State.IN_DOUBT:
                continue
            if batch.state in _WAITING and error is not None and survives_failure(error):
                batch.kept = True
                continue
            batch.state = State.IN_DOUBT

    def settle(self) -> None:
        """Finish the batches in doubt by looking their gids up (after reconnecting)."""
        store = self._store()
        for batch in [b for b in self.in_flight.values() if b.state is State.IN_DOUBT]:
            with self._writing("commit_prepared" if batch.evidence else "rollback_prepared"):
                if store.gid_exists(batch.gid) and store.finish(batch.gid, commit=batch.evidence):
                    outcome = "committed" if batch.evidence else "rolled_back"
                else:
                    outcome = "finished_elsewhere"
            if batch.evidence:
                self._count_committed(batch)
            else:
                self.stats.batches_rolled_back += 1
                if outcome == "rolled_back":
                    # What went out for it is on the broker, or may be: sent again.
                    self.stats.duplicates_possible += _sent(batch)
            emit(log, "batch.settled", logging.WARNING, gid=batch.gid, outcome=outcome)
            del self.in_flight[batch.gid]

    def resumed(self) -> None:
        """The relay took its id back after losing its control session (the hand-over,
        module docstring): a batch still in flight whose gid is gone was finished by a
        resolver that held the id before (committed from its ledger record, or
        rolled back without one); the others are the relay's to finish, as before.
        Batches in doubt are looked up by ``settle`` as always."""
        store = self._store()
        for batch in [b for b in self.in_flight.values() if b.state is not State.IN_DOUBT]:
            with self._writing("commit_prepared"):
                present = store.gid_exists(batch.gid)
            if not present:
                del self.in_flight[batch.gid]
                emit(
                    log,
                    "batch.settled",
                    logging.WARNING,
                    gid=batch.gid,
                    outcome="finished_elsewhere",
                )

    @property
    def in_doubt(self) -> bool:
        return any(b.state is State.IN_DOUBT for b in self.in_flight.values())

    # -- helpers -----------------------------------------------------------------------
    def _forget_old_unwritten(self) -> None:
        cutoff = time.monotonic() - UNWRITTEN_SECONDS
        for row_id in [i for i, (_, since) in self._unwritten.items() if since < cutoff]:
            del self._unwritten[row_id]

    def _failed(self, write: str, error: OutboxError) -> OutboxError:
        """Name the write that ``error`` failed, once (the innermost write names it),
        and count it (``outbox_write_failures_total{write}``)."""
        if error.write is None:
            error.write = write
            self.stats.write_failures[write] += 1
        return error

    @contextlib.contextmanager
    def _writing(self, write: str) -> Iterator[None]:
        try:
            yield
        except RETRYABLE as exc:
            self._failed(write, exc)
            raise

    def _store(self) -> BatchStorePort:
        assert self.store is not None, "the relay connects the store before a step"
        return self.store

    def _count_committed(self, batch: Batch) -> None:
        self.stats.batches_committed += 1
        self.stats.messages_published += batch.published
        self.stats.dead_letters += len(batch.dead)

    def _observe_claim(self, seconds: float, rows: int) -> None:
        stats = self.stats
        stats.claim_seconds.observe(seconds)
        stats.slowest_claim = max(stats.slowest_claim, seconds)
        stats.largest_claim = max(stats.largest_claim, rows)
        if seconds >= SLOW_CLAIM_SECONDS:
            emit(log, "claim.slow", logging.WARNING, ms=f"{seconds * 1000:.0f}", rows=rows)

    def _probe_ledger(self) -> None:
        """Prove the ledger takes records again before publishing another batch.

        Without evidence a batch is rolled back, so while the ledger stream is
        unavailable every retry would publish a whole batch only to duplicate it.
        """
        with self._writing("ledger"):
            [entry] = self.broker.publish(
                [ledger.probe(self.settings.ledger_queue)], self.settings.publish_timeout
            )
        if entry.outcome is not Outcome.ACCEPTED:
            raise self._failed(
                "ledger",
                BrokerUnavailable(
                    f"the ledger {self.settings.ledger_queue!r} takes no records: {entry.reason}",
                    "nothing is committed until it does; if the stream stays down after a broker "
                    "crash, see docs/explanation/limitations.md",
                ),
            )
        self.ledger_doubtful = False
