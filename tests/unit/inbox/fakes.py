"""In-memory doubles of the consumer loop's two ports (``steps.StorePort`` and
``steps.BrokerPort``), like ``tests/fixtures/fakes.py`` for the relay's batch loop.

``FakeStore`` keeps an inbox, attempts, parked rows, custody and effects, with one open
transaction at a time; its ``FakeConnection`` is what a handler is handed and can
misbehave with in every way a psycopg connection allows (commit, roll back,
close, lose its session, abort the transaction, change settings).  As in
PostgreSQL: the session is read-only outside the consumer's transactions, and a
COMMIT by a handler fails while the transaction holds recorded ids (the inbox's
guard trigger).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from outbox.amqp.message import InboxMessage
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
    Stored,
)
from outbox.errors import BrokerUnavailable, DatabaseUnavailable, OutboxError, StatementTimedOut

Journal = list[str]


class FakeError(Exception):
    """What the fake connection raises where psycopg would raise."""


class FakeConnection:
    """The handler's view: ``apply(effect)`` writes an effect in the transaction."""

    def __init__(self, store: FakeStore) -> None:
        self._store = store
        self.closed = False
        self.broken = False
        self.status = "idle"
        self.autocommit = False
        self.isolation_level: Any = None
        self.read_only: Any = None
        self.deferrable: Any = None
        self.row_factory: Any = "tuple_row"
        self.cursor_factory: Any = "Cursor"
        self.server_cursor_factory: Any = "ServerCursor"
        self.prepare_threshold: Any = 5
        self.prepared_max: Any = 100

    def _statement(self) -> None:
        if self.closed:
            raise FakeError("the connection is closed")
        if self.broken:
            raise FakeError("server closed the connection unexpectedly")
        if self.status == "inerror":
            raise FakeError("current transaction is aborted")

    def apply(self, effect: str) -> None:
        self._statement()
        if self.status == "idle":  # autocommit, and the session is read-only
            raise FakeError("cannot execute INSERT in a read-only transaction")
        self._store.pending_effects.append(effect)

    def fail_statement(self) -> None:
        """A statement that fails: the transaction is aborted."""
        self._statement()
        if self.status == "intrans":
            self.status = "inerror"
        raise FakeError("division by zero")

    def commit(self) -> None:
        self._statement()
        if self.status == "idle":
            return
        if self._store.pending_ids and self._store.guard == "armed":
            self._store._discard()
            raise FakeError("a handler committed the transaction of outbox consume")
        self._store._commit()

    def rollback(self) -> None:
        if self.status != "idle":
            self._store._discard()

    def close(self) -> None:
        self.closed = True
        self._store._discard()

    def lose_session(self) -> None:
        """The server ends the session (a timeout, pg_terminate_backend, a crash)."""
        self.broken = True
        self._store._discard()


class FakeStore:
    def __init__(self, journal: Journal | None = None) -> None:
        self.journal = journal if journal is not None else []
        self.inbox: set[str] = set()
        self.effects: list[str] = []
        self.attempts: dict[str, int] = {}
        self.last_error: dict[str, str] = {}
        self.locked: set[str] = set()  # attempt locks held
        self.parked: list[Parking] = []
        # <inbox>_custody: rows as next_in_custody gives them, plus their ordering key
        # and the monotonic time they are due (``delay_custody``).
        self.custody: list[dict[str, Any]] = []
        self._custody_ids = itertools.count(1)
        self.pending_ids: list[str] = []
        self.pending_effects: list[str] = []
        self.pending_forget: list[str] = []
        self.guard = ""
        self.started = 0  # when the open transaction started (a counter)
        self.conn = FakeConnection(self)
        # name of a method → the error its next call raises (then it is forgotten)
        self.fail_next: dict[str, OutboxError] = {}
        # the server is down: every statement and every connect fails
        self.down = False

    # -- the transaction ------------------------------------------------------------
    def _begin(self) -> None:
        self.started += 1
        self.conn.status = "intrans"

    def _discard(self) -> None:
        self.pending_ids, self.pending_effects, self.pending_forget = [], [], []
        self.guard = ""
        if not (self.conn.closed or self.conn.broken):
            self.conn.status = "idle"

    def _commit(self) -> None:
        self.inbox.update(self.pending_ids)
        self.effects.extend(self.pending_effects)
        for key in self.pending_forget:
            self.attempts.pop(key, None)
            self.custody = [row for row in self.custody if row["message_id"] != key]
        self._discard()

    def _maybe_fail(self, name: str) -> None:
        error = self.fail_next.pop(name, None)
        if error is not None:
            raise error
        if self.down or self.conn.broken or self.conn.closed:
            self.conn.broken = True
            raise DatabaseUnavailable(f"lost the connection while {name}")

    # -- StorePort ---------------------------------------------------------------------
    @property
    def connection(self) -> FakeConnection:
        return self.conn

    @property
    def broken(self) -> bool:
        return self.conn.broken or self.conn.closed

    def record_ids(self, keys: Sequence[str], redelivered: Sequence[str]) -> tuple[int, set[str]]:
        self.journal.append(f"record_ids {list(keys)}")
        self._maybe_fail("record_ids")
        self._begin()  # BEGIN READ WRITE
        new = {k for k in keys if k not in self.inbox and k not in self.pending_ids}
        self.pending_ids.extend(sorted(new))
        self.pending_forget.extend(redelivered)
        self.guard = "armed"
        return self.started, new

    def seal(self) -> int:
        self.journal.append("seal")
        self._maybe_fail("seal")
        if self.conn.status == "idle":
            return -1  # a statement outside a transaction: it started just now
        self.guard = "sealed"
        return self.started

    # Pipeline mode: a fake statement's outcome is known at once, so the block
    # changes nothing but the order the loop reads the seal in.
    pipelining = True
    idle_timeout: float | None = None

    def pipeline(
        self, record: tuple[Sequence[str], Sequence[str]] | None = None
    ) -> contextlib.AbstractContextManager[Callable[[], tuple[int, set[str]]] | None]:
        if record is None:
            return contextlib.nullcontext()
        try:
            recorded = self.record_ids(*record)  # ahead of the handlers, as in the pipeline
        except OutboxError as exc:
            return self._aborted(exc)
        return contextlib.nullcontext(lambda: recorded)

    @contextlib.contextmanager
    def _aborted(self, exc: OutboxError) -> Iterator[Callable[[], tuple[int, set[str]]]]:
        """A pipeline whose first statements failed: the handlers' statements fail
        (the transaction is aborted) and the sync raises the error as PostgreSQL
        reports it there (a lock wait that timed out is no ``InboxRowHeld`` yet)."""
        self._begin()
        self.conn.status = "inerror"
        if isinstance(exc, DatabaseUnavailable) and not isinstance(exc, StatementTimedOut):
            self.conn.broken = True  # the session is gone

        def recorded() -> tuple[int, set[str]]:
            raise exc

        yield recorded
        if isinstance(exc, InboxRowHeld):
            raise StatementTimedOut(exc.message, exc.hint)
        raise exc

    def send_seal(self) -> Callable[[], int]:
        started = self.seal()
        return lambda: started

    def commit(self) -> None:
        self.journal.append("commit")
        self._maybe_fail("commit")
        self._commit()

    def commit_unless(self, unless: Callable[[], str | None]) -> str | None:
        reason = unless()
        if reason is None:
            self.commit()
        return reason

    def rollback(self) -> None:
        self.journal.append("rollback")
        self._maybe_fail("rollback")
        self._discard()

    def session(self) -> SessionState:
        conn = self.conn
        return SessionState(
            closed=conn.closed,
            broken=conn.broken,
            transaction="unknown" if conn.closed or conn.broken else conn.status,
            settings=tuple(getattr(conn, name) for name in SETTINGS),
        )

    def restore(self, state: SessionState) -> None:
        self.journal.append("restore")
        for name, value in zip(SETTINGS, state.settings, strict=True):
            setattr(self.conn, name, value)

    def reconnect(self) -> None:
        self.journal.append("reconnect")
        error = self.fail_next.pop("reconnect", None)
        if error is not None:
            raise error
        if self.down:
            raise DatabaseUnavailable("cannot connect")
        self._discard()
        self.conn = FakeConnection(self)

    def record_failure(
        self,
        message_id: str,
        error: str,
        *,
        max_attempts: int,
        parking: Parking,
        counted: bool = False,
    ) -> Failure:
        self.journal.append(f"record_failure {message_id}")
        self._maybe_fail("record_failure")
        self.last_error[message_id] = error
        attempts = self.attempts.get(message_id, 0) + (
            0 if counted and message_id in self.attempts else 1
        )
        self.attempts[message_id] = attempts
        if attempts < max_attempts:
            return Failure(attempts, parked=False)
        del self.attempts[message_id]
        if message_id in self.inbox:
            return Failure(attempts, parked=False, duplicate=True)
        self.inbox.add(message_id)
        self.parked.append(dataclasses.replace(parking))
        return Failure(attempts, parked=True)

    def start_attempt(self, message_id: str, *, max_attempts: int) -> Started:
        """Committed at once (its own transaction), as in PostgreSQL."""
        self.journal.append(f"start_attempt {message_id}")
        self._maybe_fail("start_attempt")
        if message_id in self.inbox:
            return Started(duplicate=True, earlier=0, last_error="")
        earlier = self.attempts.get(message_id, 0)
        if earlier < max_attempts:
            self.attempts[message_id] = earlier + 1
        self.locked.add(message_id)
        return Started(False, earlier, self.last_error.get(message_id, ""))

    def uncount_attempt(self, message_id: str) -> None:
        self.journal.append(f"uncount_attempt {message_id}")
        if self.attempts.get(message_id, 0) > 0:
            self.attempts[message_id] -= 1

    def end_attempt(self, message_id: str) -> None:
        self.journal.append(f"end_attempt {message_id}")
        self.locked.discard(message_id)

    def park(self, parking: Parking) -> None:
        self.journal.append("park")
        self._maybe_fail("park")
        self.parked.append(parking)

    def take_custody(self, queue: str, messages: Sequence[Stored]) -> None:
        self.journal.append(f"take_custody {[m.message_id for m in messages]}")
        self._maybe_fail("take_custody")
        held = {row["message_id"] for row in self.custody}
        for m in messages:
            if m.message_id in self.inbox or m.message_id in held:
                continue
            held.add(m.message_id)
            self.custody.append(
                {
                    "id": next(self._custody_ids),
                    "message_id": m.message_id,
                    "ordering_key": m.ordering_key,
                    "queue": queue,
                    "exchange": m.exchange,
                    "routing_key": m.routing_key,
                    "body": m.body,
                    "raw_properties": m.raw_properties,
                    "due": 0.0,
                }
            )

    def next_in_custody(self, limit: int) -> InCustody:
        self._maybe_fail("next_in_custody")
        now = time.monotonic()
        heads: dict[object, dict[str, Any]] = {}
        for row in self.custody:  # in id order
            key = row["ordering_key"] if row["ordering_key"] is not None else ("id", row["id"])
            heads.setdefault(key, row)
        due = [r for r in heads.values() if r["due"] <= now]
        later = [r["due"] - now for r in heads.values() if r["due"] > now]
        columns = ("id", "message_id", "queue", "exchange", "routing_key", "body", "raw_properties")
        return InCustody(
            due=[tuple(r[c] for c in columns) for r in sorted(due, key=lambda r: r["id"])][:limit],
            held=len(self.custody),
            next_in=min(later) if later else None,
        )

    def delay_custody(self, message_id: str, delay: float) -> None:
        self.journal.append(f"delay_custody {message_id}")
        for row in self.custody:
            if row["message_id"] == message_id:
                row["due"] = time.monotonic() + delay

    def release_custody(self, message_id: str) -> None:
        self.journal.append(f"release_custody {message_id}")
        self.custody = [row for row in self.custody if row["message_id"] != message_id]

    def ensure_schema(self, wait: Callable[[SchemaWait], None] | None = None) -> None:
        self._maybe_fail("ensure_schema")

    def prune(self, retention_seconds: float, *, batch: int, max_batches: int) -> int:
        return 0

    def close(self) -> None:
        self.conn.closed = True


@dataclasses.dataclass
class FakeDelivery:
    message: InboxMessage
    tag: int
    subscription: int = 0


class FakeBroker:
    """A queue of messages; unacked ones go back to the head on reject or close."""

    def __init__(
        self, messages: Sequence[InboxMessage], prefetch: int = 10, per_drain: int | None = None
    ) -> None:
        self.ready: list[InboxMessage] = list(messages)
        self.unacked: list[FakeDelivery] = []
        # ``per_drain``: the broker fills the window at once (those deliveries are
        # unacked, on their way), a drain hands out at most this many of them, as a
        # real one takes at most a batch from the socket.  None: the whole window.
        self.per_drain = per_drain
        self._on_the_way: list[FakeDelivery] = []
        self.acked: list[InboxMessage] = []
        self.prefetch = prefetch
        self.connected = False
        self.policy = QueuePolicy()
        self._tag = 0
        self.subscription = 0
        self.journal: Journal = []
        self.fail_next: dict[str, OutboxError] = {}
        # Acks kept back (``hold_acks``), and deliveries a cancel returned (quorum).
        self.held_acks: list[tuple[FakeDelivery, bool]] | None = None
        self.returned = 0

    def open(self) -> None:
        error = self.fail_next.pop("open", None)
        if error is not None:
            raise error
        self.connected = True

    def drain(self, timeout: float) -> list[FakeDelivery]:
        if not self.connected:
            raise BrokerUnavailable("not connected")
        got = self._on_the_way
        while self.ready and sum(map(self.subscribed, self.unacked)) < self.prefetch:
            self._tag += 1
            message = self.ready.pop(0)
            delivery = FakeDelivery(message, self._tag, self.subscription)
            self.unacked.append(delivery)
            got.append(delivery)
        # Those of an earlier subscription all come at once (``Broker.resubscribe``
        # keeps them for the next drain).
        older = sum(1 for d in got if not self.subscribed(d))
        most = len(got) if self.per_drain is None else older + self.per_drain
        got, self._on_the_way = got[:most], got[most:]
        if not got:
            self.release_acks()  # as ``Broker.drain``: the window may never fill
        return got

    def settle(self, delivery: FakeDelivery, *, ack: bool, multiple: bool = False) -> None:
        if ack and self.held_acks is not None and self.subscribed(delivery):
            self.held_acks.append((delivery, multiple))
            return
        if ack:
            settled = [d for d in self.unacked if d.tag <= delivery.tag] if multiple else [delivery]
            for d in settled:
                self.unacked.remove(d)
                self.acked.append(d.message)
                self.journal.append(f"ack {d.message.message_id}")
        else:
            self.unacked.remove(delivery)
            self.ready.insert(0, dataclasses.replace(delivery.message, redelivered=True))
            self.journal.append(f"reject {delivery.message.message_id}")

    def subscribed(self, delivery: FakeDelivery) -> bool:
        """RabbitMQ counts a consumer's prefetch per subscription."""
        return delivery.subscription == self.subscription

    def resubscribe(self) -> None:
        if self.policy.queue_type == "quorum" and self.ready and not self.window_in_hand():
            # A quorum queue returns what was on its way to the cancelled subscription.
            self.returned += 1
        self.subscription += 1
        self.journal.append("resubscribe")
        self.release_acks()

    def window_in_hand(self) -> bool:
        return sum(map(self.subscribed, self.unacked)) >= self.prefetch

    def hold_acks(self) -> None:
        if self.held_acks is None:
            self.held_acks = []

    def release_acks(self) -> None:
        held, self.held_acks = self.held_acks, None
        for delivery, multiple in held or ():
            self.settle(delivery, ack=True, multiple=multiple)

    def busy(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def stop_consuming(self) -> None:
        pass

    def close(self) -> None:
        self.held_acks = None
        for d in reversed(self.unacked):
            self.ready.insert(0, dataclasses.replace(d.message, redelivered=True))
        self.unacked = []
        self._on_the_way = []
        self.connected = False


def message(message_id: str | None, body: bytes = b"x", **changes: Any) -> InboxMessage:
    base = InboxMessage(message_id, body, {}, "ex", "k", None, False, "q")
    return dataclasses.replace(base, **changes)
