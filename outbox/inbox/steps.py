"""The steps of each message: one transaction of messages over the store port.

Exactly-once effects on the consumer side (``outbox consume`` and ``Inbox``), step
by step, with the state of each message and the crash table.

The promise: every delivered message ends in exactly one place, one committed
effect or parked with the reason, and a later copy of either is skipped.  The
consumer exits only on a signal or a start-up error; no message makes it exit,
loop or stall the queue.  Only a real outage of its own servers is retried as an
outage, and the message in hand still gets its attempt counted.

One transaction of messages, in this order (``Processor.transaction``)::

    record_ids      INSERT the batch's ids ... ON CONFLICT DO NOTHING
                    (the ones already there are duplicates: acked, no effect)
    for each new message:
        handler(conn, message)            -- the effect, on the same connection
        check what the handler left       -- pure: ``handler_left``
    seal            the same transaction still? (a handler may have ended it)
    COMMIT
    ack

A pipelined batch of first deliveries records its ids ahead (``record_ahead``): the
INSERT goes out in the pipeline with the handlers' statements instead of waiting for
its own round trip first, on the bet that every id is new (a duplicate that was not
redelivered is rare: a relay's crash window, a foreign publisher).  It is a plain
INSERT (``record_new``): an id already there fails it and aborts the transaction,
so nothing of the batch can commit, not even by a handler's own COMMIT (with ON
CONFLICT DO NOTHING a batch of copies would insert no row and arm no guard).  If the
batch fails in any way, the transaction is rolled back and the batch runs again the
way above, ids first, so a duplicate's effect never commits and every failure is
attributed as before (the handlers of a batch recorded ahead may run twice; only
their effects commit once).  After such a rerun the next ``AHEAD_PAUSE`` batches
record their ids first.

Messages that are already here when the consumer looks (at most half ``--prefetch``)
go through this in ONE transaction and are acked after its single COMMIT: a busy
consumer pays one durable commit per batch, not per message.  If a handler fails
inside a batch, the batch is rolled back and its messages are applied one by one,
so a failing message costs only itself (a handler may run more than once for a
message; only its database effect commits once).

In a batch the handlers run in psycopg's pipeline mode: their statements and the
seal go out without waiting and are resolved at one sync, then the COMMIT runs on
its own (``Processor.transaction``).  A handler sees what it would see without it:
a result it fetches or a cursor property it reads (``rowcount``, ...) is waited for
(``store.PipelinedCursor``); an error of its statement may only show at the sync,
which breaks the batch, applied again one by one without pipelining.  A handler
whose batch fails pipelined and succeeds one by one (COPY, an error caught where it
was raised) turns pipelining off for the process (``consumer.pipeline_off``); a
session lost meanwhile (a server restart, ``pg_terminate_backend``) is no such sign
and leaves it on (``Broken.lost``).

The handler contract, enforced after each call: a handler that raises (any
``BaseException``, ``SystemExit`` and ``KeyboardInterrupt`` included), commits,
rolls back, closes the connection, leaves it aborted, changes its settings
(row factory, autocommit, isolation, ...) or gets its session ended by the server
(``idle_in_transaction_session_timeout``, ``pg_terminate_backend``), or returns
a coroutine or generator (its code never ran: ``not_run``) has failed.
Its message, and only it, counts the attempt; the transaction is rolled back
and the session is replaced by a clean one (``store.restore``).  A COMMIT run
by a handler fails by itself (the inbox's ``guard`` trigger, see ``inbox.sql``),
and outside the consumer's transactions the session is read-only, so no
message's id is ever committed without its own effect, nor an effect without
its id (``store``).  A session that
cannot be replaced at once is an outage: the consumer backs off and reconnects,
and counts the attempt of the message in hand once the database is back.

``BaseException`` policy: whatever a handler raises is that message's failure.
``SystemExit`` never ends the consumer.  ``KeyboardInterrupt`` cannot be Ctrl-C
in ``outbox consume`` (SIGINT/SIGTERM only set a flag there), so it is a failure
too; without the signal handlers (``consume(..., install_signal_handlers=False)``
in an application) it may be Ctrl-C, so it also stops the consumer once the
batch in hand is settled.

Redelivered messages (AMQP ``redelivered``: delivered before and not acked, after
a consumer died or lost its connection with them in hand) are
applied one at a time after the others (``Processor.alone``)::

    start_attempt   lock the message's id (session advisory lock), then in its own
                    transaction (async commit, one round trip): id in the inbox ->
                    a duplicate, lock released; earlier attempts >= --max-attempts
                    -> park it, no handler call; else count one more attempt
    the steps above, for this message alone   (success: its count goes in the COMMIT)
    failure         only its error is recorded (the attempt is counted already)
    end_attempt     unlock

A message whose handler kills the process (a segfault, the OOM killer,
``os._exit``) always comes back redelivered, and no ``except`` counts that
attempt: it is counted before the call instead, and once its attempts reach
``--max-attempts`` the next redelivery parks it unseen (``plan``).  Alone, so that
a death is counted against the message whose handler ran: a batch whose 37th
message kills the process comes back whole, and only the 37th accumulates
attempts.  The first death, in a batch, is not counted (nothing is written before
a batch), so a killer costs ``--max-attempts`` + 1 deaths.  The lock makes a
consumer that holds a copy of the message wait for this outcome, so a copy in
flight is never counted as an attempt.  The outcome of a failed call is its
recorded error: the session of a failed handler is replaced before that record
(``store.restore``), so the old session, which holds the lock, stays open and
idle until ``end_attempt`` ends it; otherwise a waiting copy would go on between
the two and read a count without its error (and, at ``--max-attempts``, park the
message a second time as unfinished).  A database lost before that record: the
process records the error once the database is back (``settle_owed``); a copy
another process applies meanwhile, or after this one died, sees a count without an
outcome, and at ``--max-attempts`` parks the message saying just that: the outcome
of the last attempt is unknown (``unfinished_reason``).  First deliveries keep the batch path
without any extra statement.  A redelivered message costs two more round trips
(count, unlock), an asynchronous commit, and a transaction of its own instead of
a share of a batch's (after a consumer restart: up to ``--prefetch`` messages,
once).  Their counts go with their effects.  Being in flight when a consumer
stops does not count (SIGTERM finishes the call in hand); a kill -9 of the
consumer while a redelivered message's handler runs counts as its attempt, as
the killer's own death does.

Crash table (kill -9 or a lost connection at any point):

| crash point | state left | when the message comes back |
|---|---|---|
| before COMMIT (ids, handler) | rolled back, unacked | applied then (redelivered: alone) |
| killed in the handler (by it, or kill -9) | rolled back, unacked (1) | alone, counted (2) |
| alone: after the count, before the handler | its attempt committed, unacked | alone, counted (2) |
| alone: the handler raised, error not recorded | its attempt committed, unacked | counted (3) |
| after COMMIT, before the acks | effects and ids committed, unacked | ids found: acked, no effect |
| after the ack | done | (a relay duplicate) id found: skipped |
| database lost during COMMIT | outcome unknown here | the inbox decides: applied once |

(1) applied alone (redelivered): its attempt was committed before the call; in a
batch (a first delivery): nothing counted.  (2) redelivered, applied alone with its
attempt counted first; once its attempts reached ``--max-attempts``: parked unseen.
(3) a lost database, the same process alive: it records the error first, once
the database is back (parked with it at ``--max-attempts``); else parked unseen,
with "the outcome of the last attempt unknown".

A failed attempt is counted in ``<inbox>_attempts`` (once: a redelivered
message's was counted before the call) and the message waits in the consumer's
hands, unacked, for a short capped backoff (``--retry-delay``, doubling up to
``--retry-delay-max``), while the messages behind it go on, except those of its
ordering key, which wait behind it (``Inbox._hold``).  It never goes back to the
queue for a retry: a quorum queue would count a delivery against its
``x-delivery-limit``, and a TTL would run.  At ``--max-attempts`` it is parked in
``<inbox>_parked`` (with its id recorded, in one transaction) and acked, so it
never blocks the queue; ``outbox parked retry`` puts it back (as a new delivery,
its count reset).  A message without a ``message_id`` (or whose properties cannot
be read) cannot be deduplicated: it is parked at once and the handler never sees it.

A message whose inbox row (or attempt lock) another transaction holds costs one short
wait, not one per try: the steps that record ids and count attempts run under
``store.RECORD_LOCK_TIMEOUT`` (0.2 s; the handlers keep the session's lock_timeout),
after which the message is ``HELD`` (``Processor._held``): no handler call, no
attempt (one ``start_attempt`` counted is taken back: ``uncount_attempt``), kept in
hand like a failed one, its key's later messages behind it, and tried again after
``planning.row_held_delay``, never parked for it.  A batch with such an id is
applied one by one, so only that message waits.

The queue's own policy (``policy``, read at start-up): a stream is refused; on a
quorum queue with a delivery limit, a crash of the consumer returns every message
in hand and counts a delivery against each, so a message the broker returned is
taken into custody as it arrives (``custody``: stored and acked in one transaction
per drain, before any handler runs) and applied from ``<inbox>_custody`` through
``alone``; the transaction of its effect deletes its row (``record_messages``).

| crash point (custody) | state left | what happens next |
|---|---|---|
| arrived, before take_custody commits | unacked | returned again (counted) |
| after take_custody, before the acks | stored, unacked | the copy: skipped |
| after the acks | stored; the broker has none | applied from custody |
| in its handler (from custody) | stored, attempt counted | alone again (2) |
| after its effect's COMMIT | effect, id, row gone | done |

Roles: ``Processor`` (this module) is one transaction of messages (the steps
above; the database only, through ``StorePort``); ``Inbox`` (``process``) is the
process (start, receive, settle, reconnect with backoff, retention, stop; the
broker through ``BrokerPort``); the decisions both take are pure (``planning``).
``outbox.db.inbox`` runs the statements, ``outbox.amqp.consumer`` holds the kombu
code, ``outbox.amqp.message`` the handler's view of a delivery.  Unit tests run both
roles on in-memory fakes (``tests/unit/inbox/fakes.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from outbox.amqp.message import (
    KEPT_PROPERTIES,
    InboxMessage,
    inbox_key,
    json_safe,
    text_safe,
)
from outbox.amqp.policy import QueuePolicy
from outbox.db.inbox import (
    SETTINGS,
    Failure,
    InboxRowHeld,
    InCustody,
    Parking,
    SchemaWait,
    SessionState,
    Started,
    StatementRefused,
    Stored,
    describe,
)
from outbox.errors import DatabaseUnavailable, OutboxError
from outbox.events import emit
from outbox.inbox.handlers import Handler
from outbox.inbox.planning import (
    Disposition,
    Dispositions,
    Plan,
    plan,
    retry_delay,
    unfinished_reason,
    unusable,
)
from outbox.inbox.settings import ConsumerSettings
from outbox.inbox.stats import ConsumerStats

log = logging.getLogger("outbox.inbox")

# Batches that record their ids first after one recorded ahead had to run again
# (duplicates come in runs: a relay's crash window republishes a whole batch).
AHEAD_PAUSE = 8

# How to read what the ids recorded ahead gave: when the transaction started, and
# the ids that were new.
Recorded = Callable[[], tuple[object, set[str]]]


# -- the ports ------------------------------------------------------------------------------
class StorePort(Protocol):
    """The statements ``Processor`` runs (``store.InboxStore``; a fake in unit tests)."""

    @property
    def connection(self) -> Any: ...  # handed to the handler

    @property
    def broken(self) -> bool: ...

    def record_ids(
        self, keys: Sequence[str], redelivered: Sequence[str]
    ) -> tuple[object, set[str]]: ...

    def seal(self) -> object: ...

    # Pipeline mode for a batch's handlers: ``pipeline()`` sends their statements
    # without waiting and resolves them when the block ends; ``send_seal`` sends the
    # seal in it and returns how to read its result after the block.  ``record``
    # (keys, redelivered): the block starts with the transaction and ``record_ids``
    # sent ahead of the handlers' statements; it gives how to read their result
    # after the block.
    @property
    def pipelining(self) -> bool: ...

    @property
    def idle_timeout(self) -> float | None: ...

    def pipeline(
        self, record: tuple[Sequence[str], Sequence[str]] | None = None
    ) -> contextlib.AbstractContextManager[Recorded | None]: ...

    def send_seal(self) -> Callable[[], object]: ...

    def commit(self) -> None: ...

    # ``unless()`` once the handlers' statements are resolved: COMMIT if it gives
    # None, else give its reason (nothing committed, the transaction still open).
    # A store may end the pipeline block there, in the COMMIT's round trip: an error
    # the block's end raises is then given as the reason.
    def commit_unless(self, unless: Callable[[], str | None]) -> str | None: ...

    def rollback(self) -> None: ...

    def session(self) -> SessionState: ...

    def restore(self, state: SessionState) -> None: ...

    def reconnect(self) -> None: ...

    def record_failure(
        self,
        message_id: str,
        error: str,
        *,
        max_attempts: int,
        parking: Parking,
        counted: bool = False,
    ) -> Failure: ...

    # A redelivered message's attempt, committed before its handler is called
    # (``Processor.alone``); ``end_attempt`` once its outcome is committed.
    def start_attempt(self, message_id: str, *, max_attempts: int) -> Started: ...

    def end_attempt(self, message_id: str) -> None: ...

    # The attempt ``start_attempt`` counted was none: the message's row was held.
    def uncount_attempt(self, message_id: str) -> None: ...

    def park(self, parking: Parking) -> None: ...

    # Custody (``outbox.inbox.custody``): messages stored before they are acked,
    # applied from the table (``Inbox._apply_custody``).
    def take_custody(self, queue: str, messages: Sequence[Stored]) -> None: ...

    def next_in_custody(self, limit: int) -> InCustody: ...

    def delay_custody(self, message_id: str, delay: float) -> None: ...

    def release_custody(self, message_id: str) -> None: ...

    # for the process (``Inbox``)
    # ``wait`` hears each attempt that gave up on a lock, and pauses.
    def ensure_schema(self, wait: Callable[[SchemaWait], None] | None = None) -> None: ...

    def prune(self, retention_seconds: float, *, batch: int, max_batches: int) -> int: ...

    def close(self) -> None: ...


class DeliveryPort(Protocol):
    @property
    def message(self) -> InboxMessage: ...


class BrokerPort(Protocol):
    """What ``Inbox`` asks of the broker (``broker.Broker``; a fake in unit tests)."""

    @property
    def connected(self) -> bool: ...

    # What the consumer knows of the queue's policy (read when the queue is opened).
    @property
    def policy(self) -> QueuePolicy: ...

    def open(self) -> None: ...

    def drain(self, timeout: float) -> Sequence[Any]: ...

    def settle(self, delivery: Any, *, ack: bool, multiple: bool = False) -> None: ...

    # Whether a delivery counts against the current subscription's prefetch, and a
    # new subscription with a fresh prefetch window (``Broker.resubscribe``).
    def subscribed(self, delivery: Any) -> bool: ...

    def resubscribe(self) -> None: ...

    # Before a cancel on a quorum queue: acks of the current subscription kept back
    # until its whole window is in hand (``Broker.hold_acks``).
    def window_in_hand(self) -> bool: ...

    def hold_acks(self) -> None: ...

    def release_acks(self) -> None: ...

    # Around the loop's handler calls, which make no broker call: the connection's
    # heartbeats go on meanwhile.
    def busy(self) -> contextlib.AbstractContextManager[None]: ...

    def stop_consuming(self) -> None: ...

    def close(self) -> None: ...


# -- what a handler left (pure) ------------------------------------------------------------
def handler_left(
    before: SessionState, after: SessionState, *, pending: bool = False, unsynced: bool = False
) -> str | None:
    """Why the session a handler returned breaks the contract, or None if it does
    not (the handler's transaction may go on to the COMMIT).  ``pending``: in
    pipeline mode, before the sync, where a transaction with statements in flight
    shows as active (the whole check runs again after the sync).  ``unsynced``:
    its BEGIN went out in the pipeline too (ids recorded ahead), and libpq shows
    the session idle until a sync says otherwise, once the results in flight are
    read; a handler that did end the transaction is found at the sync (and its
    effect cannot commit: ``record_new`` arms the guard or aborts the transaction)."""
    transaction = after.transaction
    if pending and (transaction == "active" or (unsynced and transaction == "idle")):
        transaction = "intrans"
    if after.closed:
        return "the handler closed the connection it was handed"
    if after.broken:
        return "the handler's session ended (the server closed it)"
    if transaction == "inerror":
        return (
            "the handler caught a database error; its transaction was aborted and cannot "
            "commit (let the error propagate, or use conn.transaction() as a savepoint "
            "around the statement that may fail)"
        )
    if transaction != "intrans":
        return (
            "the handler ended the transaction itself (commit or rollback); it must leave "
            "that to the consumer (use conn.transaction() for savepoints)"
        )
    if after.settings == before.settings:  # the common case, compared in C
        return None
    changed = [
        name
        for name, was, now in zip(SETTINGS, before.settings, after.settings, strict=True)
        if was != now
    ]
    if changed:
        return (
            f"the handler changed the connection's settings ({', '.join(changed)}); "
            "set them per cursor or per statement instead"
        )
    return None


@dataclasses.dataclass(frozen=True)
class Broken:
    """A transaction of messages that failed: ``message`` is the one whose handler
    broke it (None: no handler is to blame, e.g. a deadlock between two
    consumers' batches), ``reason`` says how."""

    message: InboxMessage | None
    reason: str
    # The session was lost and replaced meanwhile: not the handler's doing.
    lost: bool = False


# -- what a parked message keeps (pure) -----------------------------------------------------
def parking_for(message: InboxMessage, error: str) -> Parking:
    """What the store writes of ``message`` parked for ``error``: its exchange and
    routing key as inbox keys, its headers and kept properties readable as JSON, its
    raw property list as it arrived."""
    properties = {k: message.properties[k] for k in KEPT_PROPERTIES if k in message.properties}
    return Parking(
        message_id=message.message_id,
        queue=message.queue,
        exchange=inbox_key(message.exchange),
        routing_key=inbox_key(message.routing_key),
        body=message.body,
        headers=json_safe(message.headers),
        properties=json_safe(properties),
        error=text_safe(error),
        raw_properties=message.raw_properties,
    )


# -- one transaction of messages ------------------------------------------------------------
class Processor:
    """Apply messages through the inbox; no broker I/O.  Returns each message's
    outcome and, for ``RETRY``, how long to wait before its next attempt.
    ``DatabaseUnavailable`` means: an outage; do not ack; the messages come back and
    the inbox decides then."""

    def __init__(
        self,
        store: StorePort,
        handler: Handler,
        settings: ConsumerSettings,
        stats: ConsumerStats,
        *,
        on_interrupt: Callable[[], None] | None = None,
    ) -> None:
        self.store, self.handler, self.settings, self.stats = store, handler, settings, stats
        # Called when a handler raises KeyboardInterrupt (see the BaseException policy).
        self.on_interrupt = on_interrupt
        # Attempts of messages in hand when the database went away, counted once
        # it is back (the messages themselves went back to the queue); True: the
        # attempt was counted before the call (``alone``), only its error is owed.
        self.owed: list[tuple[InboxMessage, str, bool]] = []
        # The message whose attempt is counted already while it is applied alone.
        self._counted: InboxMessage | None = None
        # Batches run their handlers in pipeline mode (see ``transaction``) until a
        # handler shows it cannot (a batch fails there and every message of it
        # succeeds one by one: e.g. COPY, or logic on an error caught at once).
        # A lost session is no such sign: pipelining stays on through outages.
        self.pipelining = store.pipelining
        # Batches left that record their ids first (``record_ahead``).
        self.ahead_paused = 0
        # The queue's policy (``Inbox`` sets it once the broker has read it).
        self.policy = QueuePolicy()

    def process_batch(self, messages: Sequence[InboxMessage]) -> Dispositions:
        """Apply messages that are already here in ONE transaction (one commit for
        all); if it fails, apply them one by one, so a failing message costs only
        itself.  Redelivered messages are applied alone, after the others, each
        with its attempt committed first (``alone``)."""
        self.settle_owed()
        if not any(m.redelivered for m in messages):  # the hot path
            return self._batch(messages)
        outcomes: list[tuple[Disposition, float]] = []
        first = [m for m in messages if not m.redelivered]
        applied = iter(self._batch(first) if first else [])
        redelivered = [i for i, m in enumerate(messages) if m.redelivered]
        again = dict(
            zip(redelivered, self.one_by_one([messages[i] for i in redelivered]), strict=True)
        )
        for i in range(len(messages)):
            outcomes.append(again[i] if i in again else next(applied))
        return outcomes

    def _batch(self, messages: Sequence[InboxMessage]) -> Dispositions:
        usable = [m for m in messages if unusable(m) is None]
        if len(usable) < 2:
            return [self.process(m) for m in messages]
        pipelined = self.pipelining and self.store.pipelining
        done = self.transaction(usable, pipelined=pipelined)
        if isinstance(done, Broken):
            emit(log, "consumer.batch_split", logging.DEBUG, size=len(messages), error=done.reason)
            replayed = self.one_by_one(messages)
            if pipelined and needs_sync_mode(done, messages, replayed):
                # Failed in pipeline mode, applied without it: this handler needs
                # each statement's outcome at once.  Batches go on without pipelining.
                self.pipelining = False
                emit(log, "consumer.pipeline_off", logging.WARNING, reason=done.reason)
            return replayed
        applied = iter(done)
        return [self._park_unusable(m) if unusable(m) else next(applied) for m in messages]

    def one_by_one(self, messages: Sequence[InboxMessage]) -> Dispositions:
        """``process`` each message in turn, except those of an ordering key whose
        earlier message failed here: they stay ``BEHIND`` it, unapplied, so that
        the key keeps its order."""
        outcomes: Dispositions = []
        failed: set[str] = set()
        for message in messages:
            key = message.ordering_key
            if key is not None and key in failed:
                outcomes.append((Disposition.BEHIND, 0.0))
                continue
            outcome = self.process(message)
            if outcome[0] in (Disposition.RETRY, Disposition.HELD) and key is not None:
                failed.add(key)
            outcomes.append(outcome)
        return outcomes

    def process(self, message: InboxMessage) -> tuple[Disposition, float]:
        """Apply one message in its own transaction (a redelivered one, or one from
        custody: ``alone``)."""
        self.settle_owed()
        if unusable(message):
            return self._park_unusable(message)
        if message.redelivered:
            return self.alone(message)
        done = self.transaction([message])
        if isinstance(done, Broken):
            return self._failed(message, done.reason)
        return done[0]

    def alone(self, message: InboxMessage) -> tuple[Disposition, float]:
        """A redelivered message: it may be the one that killed the consumer that
        held it (a segfault, the OOM killer, ``os._exit`` in its handler), which no
        ``except`` can count.  So its attempt is committed before the handler is
        called, in a transaction of its own, under a lock that makes a consumer
        holding a copy of it wait for this outcome; and once its earlier attempts
        reach ``--max-attempts`` it is parked without a call (``plan``).  Alone, so
        that a death is counted against the message whose handler ran, not against
        a whole batch."""
        message_id = str(message.message_id)
        store, max_attempts = self.store, self.settings.max_attempts
        try:
            started = store.start_attempt(message_id, max_attempts=max_attempts)
        except InboxRowHeld as exc:
            return self._held(message, exc)
        if started.duplicate:  # lock released already
            return self._duplicate(message)
        try:
            if plan(True, started.earlier, max_attempts) is Plan.PARK:
                outcome = self._park_unfinished(message, started)
            else:
                self._counted = message
                try:
                    done = self.transaction([message])
                finally:
                    self._counted = None
                if isinstance(done, Broken):
                    outcome = self._failed(message, done.reason, counted=True)
                else:
                    outcome = done[0]
                if outcome[0] is Disposition.HELD:
                    # Held at the record step, no handler called: not an attempt.  A
                    # count that stays (its counter row held too) is only one more.
                    with contextlib.suppress(InboxRowHeld):
                        store.uncount_attempt(message_id)
        except BaseException:
            with contextlib.suppress(OutboxError):
                store.end_attempt(message_id)
            raise
        store.end_attempt(message_id)
        return outcome

    def transaction(
        self, messages: Sequence[InboxMessage], *, pipelined: bool = False
    ) -> Dispositions | Broken:
        """The steps of one transaction (see the module docstring).  On ``Broken``
        the transaction is rolled back and the session is usable again.  A
        pipelined batch records its ids ahead when ``record_ahead`` says so, and
        runs again with its ids recorded first if that was not the whole story."""
        if record_ahead(messages, pipelined=pipelined, paused=self.ahead_paused):
            done = self._transaction(messages, pipelined=True, ahead=True)
            if done is not None:
                return done
            self.ahead_paused = AHEAD_PAUSE
        elif pipelined and self.ahead_paused:
            self.ahead_paused -= 1
        done = self._transaction(messages, pipelined=pipelined)
        assert done is not None  # only a batch recorded ahead runs again
        return done

    def _transaction(
        self, messages: Sequence[InboxMessage], *, pipelined: bool, ahead: bool = False
    ) -> Dispositions | Broken | None:
        """``transaction``, once.  ``ahead``: the ids are recorded in the pipeline,
        all taken for new; None if the batch must run again without that (an id
        was there already, or something failed: rolled back, session restored).

        ``pipelined``: the handlers' statements and the seal go out in pipeline
        mode and are resolved together at one sync, one round trip for the batch
        instead of one per statement.  A statement's error then shows at the sync
        or in a later handler, not in its own handler: any failure breaks the batch,
        which ``process_batch`` applies again one by one without pipelining (where
        each handler sees its own errors and its own message is named).  The COMMIT
        is never pipelined: it runs only after the sync, once the session is found
        in the same transaction, untouched (``handler_left``) and sealed."""
        store = self.store
        before = store.session()
        keys = [str(m.message_id) for m in messages]
        redelivered = [str(m.message_id) for m in messages if m.redelivered]
        started: object = None
        if ahead:
            new = set(keys)
        else:
            try:
                started, new = store.record_ids(keys, redelivered)
            except StatementRefused as exc:  # e.g. two consumers' batches deadlocked
                return Broken(None, exc.message)
            except InboxRowHeld as exc:
                if len(messages) > 1:  # one by one: only the held one waits again
                    return Broken(None, exc.message)
                return [self._held(messages[0], exc)]
        outcomes: Dispositions = []
        in_hand: InboxMessage | None = None
        failed: str | None = None
        sealed: Callable[[], object] | None = None
        pipelined = pipelined and bool(new)

        def broken(reason: str) -> Broken | None:
            assert in_hand is not None
            done = self._broken(in_hand, before, reason)  # rolled back (or an outage)
            if not ahead:
                return done
            emit(log, "consumer.batch_again", logging.DEBUG, size=len(messages), reason=reason)
            return None

        try:
            block: contextlib.AbstractContextManager[Recorded | None] = (
                store.pipeline((keys, redelivered) if ahead else None)
                if pipelined
                else contextlib.nullcontext()
            )
            with block as recorded:
                run_ahead = getattr(self.handler, "outbox_run_ahead", None) if pipelined else None
                if run_ahead is not None:
                    # An async handler (``aio``) runs the batch's calls on its loop in
                    # one go; each call below gives back what its own call did.
                    run_ahead(store.connection, to_call(messages, new))
                for message in messages:
                    if message.message_id not in new:  # applied before, or earlier here
                        outcomes.append((Disposition.DUPLICATE, 0.0))
                        continue
                    new.discard(message.message_id)
                    in_hand = message
                    called = time.monotonic()
                    error = self._call(message)
                    failed = error or handler_left(
                        before, store.session(), pending=pipelined, unsynced=ahead
                    )
                    idle = store.idle_timeout
                    if not failed and pipelined and idle and time.monotonic() - called >= idle:
                        # The server would have ended the session had the
                        # statements been synced (it does not while they are not).
                        failed = (
                            f"the handler ran longer than the session's "
                            f"idle_in_transaction_session_timeout ({idle:g} s)"
                        )
                    if failed:
                        break
                    outcomes.append((Disposition.HANDLED, 0.0))
                if failed is None and in_hand is not None:
                    sealed = store.send_seal() if pipelined else _done(store.seal())
        except (DatabaseUnavailable, StatementRefused) as exc:
            if in_hand is None and ahead and isinstance(exc, StatementRefused):
                # The ids recorded ahead were refused before any handler ran (an id
                # applied before: psycopg may read that result while the block's
                # first statements are still being sent): run again, ids first.
                self._reset(before)
                emit(log, "consumer.batch_again", logging.DEBUG, size=len(messages))
                return None
            # The session ended in a handler's time, or (pipelined) a handler's
            # statement failed at the sync; the transaction is over either way.
            if in_hand is None or (isinstance(exc, StatementRefused) and not pipelined):
                raise
            return broken(failed or exc.message)
        if failed is not None:
            return broken(failed)

        def unsealed() -> str | None:
            """Why the transaction must not commit, once the handlers' statements
            are resolved (after the block; in the COMMIT's round trip for a store
            that ends the block there), or None."""
            assert sealed is not None
            left = handler_left(before, store.session()) if pipelined else None
            if left:
                return left
            begun = started
            try:
                if recorded is not None:
                    begun, recorded_new = recorded()
                    if recorded_new != set(keys):
                        return "a message of the batch was applied before"
                same = sealed() == begun
            except DatabaseUnavailable as exc:
                return exc.message
            if not same:
                return (
                    "the handler ended the transaction itself (commit or rollback) and went "
                    "on in a new one"
                )
            return None

        try:
            # DatabaseUnavailable: outcome unknown, the inbox decides.
            refusal = None
            if sealed is not None:
                refusal = store.commit_unless(unsealed)
            else:  # no handler ran: every message was applied before
                store.commit()
        except StatementRefused as exc:
            # A deferred constraint or a serialization failure refused the COMMIT:
            # the effect of a message in the transaction failed.
            store.restore(before)
            return Broken(in_hand if len(messages) == 1 else None, exc.message)
        if refusal is not None:
            return broken(refusal)
        for message, (outcome, _) in zip(messages, outcomes, strict=True):
            if outcome is Disposition.HANDLED:
                self.stats.handled += 1
            else:
                self._duplicate(message)
        return outcomes

    def _held(self, message: InboxMessage, exc: InboxRowHeld) -> tuple[Disposition, float]:
        """Another transaction holds the message's inbox row (``InboxRowHeld``, after
        ``store.RECORD_LOCK_TIMEOUT``): ``HELD``, kept in hand and tried again later
        (``Inbox._hold``), no attempt counted, no handler called; the others go on."""
        emit(
            log,
            "consumer.message_held",
            logging.WARNING,
            message_id=message.message_id,
            error=exc.message,
        )
        return Disposition.HELD, 0.0

    def _call(self, message: InboxMessage) -> str | None:
        """Call the handler; the description of what it raised, if it raised."""
        started = time.perf_counter()
        try:
            returned = self.handler(self.store.connection, message)
        except BaseException as exc:  # any of them is this message's failure (policy above)
            if isinstance(exc, KeyboardInterrupt) and self.on_interrupt is not None:
                self.on_interrupt()
            return describe(exc)
        finally:
            took = getattr(self.handler, "outbox_took", None)  # run ahead on its loop (``aio``)
            self.stats.handler_seconds.observe(
                time.perf_counter() - started if took is None else took
            )
        return None if returned is None else not_run(returned)

    def _broken(self, message: InboxMessage, before: SessionState, reason: str) -> Broken:
        """Roll back and put the session back as it was before the handler, or
        replace it if it is gone.  No new session at once: an outage
        (``DatabaseUnavailable``), and the message's attempt is owed."""
        store = self.store
        try:
            if store.broken:
                raise DatabaseUnavailable(reason)
            store.rollback()
            store.restore(before)
        except DatabaseUnavailable:
            try:
                store.reconnect()
            except DatabaseUnavailable:
                self.stats.handler_failures += 1  # its error is recorded later
                self._owe(message, reason, counted=message is self._counted)
                raise
            return Broken(message, reason, lost=True)
        return Broken(message, reason)

    def _reset(self, before: SessionState) -> None:
        """Roll back and put the session back as it was (a new one if it is gone;
        ``DatabaseUnavailable`` if none can be had: an outage)."""
        store = self.store
        try:
            if store.broken:
                raise DatabaseUnavailable("the session was lost")
            store.rollback()
            store.restore(before)
        except DatabaseUnavailable:
            store.reconnect()

    def renew_session(self) -> None:
        """A new session, with the same settings, before messages that failed are
        tried again (``store.restore``): a WITH HOLD cursor, a prepared statement
        or a temporary table that the handlers of the messages applied meanwhile
        left in the session must not fail them a second time."""
        self.store.restore(self.store.session())

    def give_up(self, message: InboxMessage, reason: str) -> tuple[Disposition, float]:
        """Park a message whose failed attempts are counted already, now."""
        message_id = str(message.message_id)
        failure = self.store.record_failure(
            message_id,
            text_safe(reason),
            max_attempts=1,
            parking=parking_for(message, reason),
            counted=True,
        )
        if failure.duplicate:
            return self._duplicate(message)
        return self._parked(message_id, failure.attempts, reason, why="failed")

    def _owe(self, message: InboxMessage, reason: str, *, counted: bool) -> None:
        self.owed.append((message, f"{reason} (then the database was unreachable)", counted))

    def settle_owed(self) -> None:
        """Record the attempts owed since an outage (see ``owed``)."""
        while self.owed:
            message, error, counted = self.owed[0]
            self._record_failure(message, error, counted=counted, owe=False)
            self.owed.pop(0)

    def _duplicate(self, message: InboxMessage) -> tuple[Disposition, float]:
        self.stats.duplicates_skipped += 1
        emit(log, "consumer.duplicate_skipped", logging.DEBUG, message_id=message.message_id)
        return Disposition.DUPLICATE, 0.0

    def _count_parked(self, reason: str) -> None:
        self.stats.parked += 1
        self.stats.parked_by[reason] += 1

    def _park_unusable(self, message: InboxMessage) -> tuple[Disposition, float]:
        reason = unusable(message) or ""
        self.store.park(parking_for(message, reason))
        self._count_parked("unusable")
        emit(log, "consumer.parked", logging.WARNING, reason=reason)
        return Disposition.PARKED, 0.0

    def _park_unfinished(
        self, message: InboxMessage, started: Started
    ) -> tuple[Disposition, float]:
        """``Plan.PARK``: the attempts counted reached the limit and the last one
        never finished; parked (id recorded, one transaction) without a call."""
        message_id = str(message.message_id)
        reason = unfinished_reason(started.earlier, started.last_error)
        failure = self.store.record_failure(
            message_id,
            text_safe(reason),
            max_attempts=self.settings.max_attempts,
            parking=parking_for(message, reason),
            counted=True,
        )
        if failure.duplicate:
            return self._duplicate(message)
        if not failure.parked:  # its count went meanwhile (retention): one more attempt
            return Disposition.RETRY, 0.0
        return self._parked(message_id, failure.attempts, reason, why="unfinished")

    def _parked(
        self, message_id: str, attempts: int, error: str, *, why: str
    ) -> tuple[Disposition, float]:
        self._count_parked(why)
        emit(
            log,
            "consumer.parked",
            logging.ERROR,
            message_id=message_id,
            attempts=attempts,
            error=error,
        )
        return Disposition.PARKED, 0.0

    def _failed(
        self, message: InboxMessage, error: str, *, counted: bool = False
    ) -> tuple[Disposition, float]:
        """Count the failed attempt of ``message`` (its own transaction; ``counted``:
        counted before the call, only its error is recorded): park it at
        ``--max-attempts``, else hold it for its retry delay."""
        self.stats.handler_failures += 1
        return self._record_failure(message, error, counted=counted, owe=counted)

    def _record_failure(
        self, message: InboxMessage, error: str, *, counted: bool, owe: bool
    ) -> tuple[Disposition, float]:
        """``_failed`` without the count of handler failures.  ``owe`` (an attempt
        counted before the call): if the database goes away before its error is
        recorded, the process records it once the database is back (``settle_owed``),
        so that the message is not parked later as one whose last attempt has no
        known outcome.  Recording it again is harmless (it only sets the error); an
        attempt not counted before is not owed: its COMMIT may have been lost after
        it ran, and a second count would park the message an attempt early."""
        message_id = str(message.message_id)
        try:
            failure = self.store.record_failure(
                message_id,
                text_safe(error),
                max_attempts=self.settings.max_attempts,
                parking=parking_for(message, error),
                counted=counted,
            )
        except DatabaseUnavailable:
            if owe:
                self._owe(message, error, counted=counted)
            raise
        if failure.duplicate:
            return self._duplicate(message)
        if failure.parked:
            return self._parked(message_id, failure.attempts, error, why="failed")
        delay = retry_delay(failure.attempts, self.settings)
        emit(
            log,
            "consumer.handler_failed",
            logging.WARNING,
            message_id=message_id,
            attempt=failure.attempts,
            retry_in=f"{delay:.2f}s",
            error=error,
        )
        return Disposition.RETRY, delay


def not_run(returned: object) -> str | None:
    """Why what a handler returned shows that its code never ran, or None: a
    coroutine it did not await, or the generator a function with ``yield`` gives
    (its body runs only when iterated).  Taken as applied, the message would be
    acked with no effect.  The coroutine or generator is closed (it never runs)."""
    if inspect.iscoroutine(returned) or inspect.isgenerator(returned):
        returned.close()  # no "never awaited" warning: this says it
    elif not (inspect.isawaitable(returned) or inspect.isasyncgen(returned)):
        return None
    what = type(returned).__name__
    if inspect.isgenerator(returned) or inspect.isasyncgen(returned):
        return (
            f"the handler returned a {what} (it contains yield): none of its code ran; "
            "a handler must be a plain or async def function without yield"
        )
    return (
        f"the handler returned a {what} it did not await: that code never ran; "
        "await it in an async def handler"
    )


def needs_sync_mode(done: Broken, messages: Sequence[InboxMessage], replayed: Dispositions) -> bool:
    """Whether a batch that failed in pipeline mode and was applied again one by one
    without it shows a handler that needs each statement's outcome at once (pure):
    the message blamed succeeded this time (applied, not skipped as a copy that
    another consumer applied meanwhile) and nothing else failed."""
    if done.message is None or done.lost:
        return False
    blamed = [o for m, (o, _) in zip(messages, replayed, strict=True) if m is done.message]
    return blamed == [Disposition.HANDLED] and all(
        o in (Disposition.HANDLED, Disposition.DUPLICATE) for o, _ in replayed
    )


def record_ahead(messages: Sequence[InboxMessage], *, pipelined: bool, paused: int) -> bool:
    """Whether a batch records its ids in the pipeline, taken for new, instead of
    first (pure): pipelined batches of two or more first deliveries, unless a batch
    recorded ahead had to run again in the last ``AHEAD_PAUSE`` batches.  A
    redelivered message may well be a duplicate (its consumer died after the
    COMMIT), and one alone gains nothing."""
    return (
        pipelined and not paused and len(messages) > 1 and not any(m.redelivered for m in messages)
    )


def to_call(messages: Sequence[InboxMessage], new: set[str]) -> list[InboxMessage]:
    """The messages whose handler ``Processor.transaction`` calls, in order, if none
    fails (pure): the first copy of each id that is ``new``."""
    left, called = set(new), []
    for message in messages:
        if message.message_id in left:
            left.discard(message.message_id)
            called.append(message)
    return called


def _done(value: object) -> Callable[[], object]:
    return lambda: value
