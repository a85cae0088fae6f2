"""Exactly-once effects on the consumer side: ``outbox consume`` and ``Inbox``.

The relay delivers every committed row at least once.  The inbox turns that into
exactly one committed effect per message in the consumer's own database:

    BEGIN
      INSERT INTO <inbox> (consumer, message_id) ... ON CONFLICT DO NOTHING
      -- already there: a duplicate; commit nothing new, ack
      handler(conn, message)            -- the effect, on the same connection
    COMMIT
    ack

Messages that are already here when the consumer looks (at most ``--prefetch``)
go through this in ONE transaction, one after the other, and are acked after its
single COMMIT: a busy consumer pays one durable commit per batch, not per
message, and an idle one still handles each message as it arrives.  If a handler
fails inside a batch, the batch is rolled back and its messages are applied one
by one, so a failing message costs only itself (and a handler may run more than
once for a message; only its database effect commits once).

Crash table (kill -9 or a lost connection at any point):

| crash point | state left | when the message comes back |
|---|---|---|
| before COMMIT (insert, handler) | rolled back, unacked | applied then |
| after COMMIT, before the acks | effects and ids committed, unacked | ids found: acked, no effect |
| after the ack | done | (a relay duplicate) id found: skipped |
| database lost during COMMIT | outcome unknown here | the inbox decides: applied once |

A handler that raises: the transaction rolls back, the failed attempt is counted in
``<inbox>_attempts``, and the message goes back to the queue after a short capped
backoff (``--retry-delay``, doubling up to ``--retry-delay-max``).  At
``--max-attempts`` it is parked in ``<inbox>_parked`` (with its id recorded, in one
transaction) and acked, so it never blocks the queue; ``outbox parked retry`` puts
it back.  A message without a ``message_id`` cannot be deduplicated: it is parked
at once and the handler never sees it.

Roles: ``Processor`` is one message's (or batch's) life (database only, no
broker); ``Inbox`` is the process (start, reconnect with backoff, retention,
stop).  ``inbox_broker`` holds the kombu code, ``inbox_store`` the psycopg code,
``inbox_message`` the handler's view of a delivery.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import logging
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import psycopg

from outbox import backoff
from outbox import fault_injection as faults
from outbox.config import _TABLE_NAME, DEFAULT_AMQP_URL, DEFAULT_DSN
from outbox.durations import Durations
from outbox.errors import BrokerUnavailable, DatabaseUnavailable, ExitCode, OutboxError
from outbox.events import emit
from outbox.inbox.broker import Broker, QueueMissing, QueuePublisher
from outbox.inbox.message import (
    KEPT_PROPERTIES,
    ORIGINAL_EXCHANGE_HEADER,
    ORIGINAL_ROUTING_KEY_HEADER,
    InboxMessage,
    json_safe,
    parking_for,
    to_inbox_message,
)
from outbox.inbox.store import DEFAULT_INBOX_TABLE, HandlerFailed, InboxStore
from outbox.relay.ordering import ORDERING_KEY_HEADER

__all__ = [
    "DEFAULT_INBOX_TABLE",
    "KEPT_PROPERTIES",
    "ORDERING_KEY_HEADER",
    "ORIGINAL_EXCHANGE_HEADER",
    "ORIGINAL_ROUTING_KEY_HEADER",
    "ConsumerSettings",
    "ConsumerStats",
    "HandlerNotFound",
    "Inbox",
    "InboxMessage",
    "Outcome",
    "Processor",
    "QueueMissing",
    "QueuePublisher",
    "consume",
    "json_safe",
    "load_handler",
    "parking_for",
    "parse_bindings",
    "retry_delay",
    "to_inbox_message",
]

log = logging.getLogger("outbox.inbox")


class HandlerNotFound(OutboxError):
    """``MODULE:FUNCTION`` cannot be imported."""

    exit_code = ExitCode.USAGE


Handler = Callable[["psycopg.Connection[Any]", InboxMessage], object]


def load_handler(spec: str) -> Handler:
    """Import ``FUNCTION`` from ``MODULE`` (``MODULE:FUNCTION``), with the current
    directory on the path as other workers' ``--app`` options do."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise HandlerNotFound(
            f"{spec!r} is not MODULE:FUNCTION", "e.g. `outbox consume handlers:on_order`"
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise HandlerNotFound(
            f"cannot import module {module_name!r}: {exc}",
            "run from the folder that holds it, or add that folder to PYTHONPATH",
        ) from exc
    except Exception as exc:
        from outbox.inbox.store import describe

        raise HandlerNotFound(f"importing {module_name!r} failed: {describe(exc)}") from exc
    target: Any = module
    for part in attribute.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise HandlerNotFound(f"module {module_name!r} has no {attribute!r}")
    if not callable(target):
        raise HandlerNotFound(f"{spec!r} is not callable")
    return target  # type: ignore[no-any-return]


# -- settings, counters, decisions ----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ConsumerSettings:
    """Everything ``outbox consume`` takes; each field is a CLI option and OUTBOX_* variable."""

    queue: str
    dsn: str = DEFAULT_DSN
    amqp_url: str = DEFAULT_AMQP_URL
    inbox_table: str = DEFAULT_INBOX_TABLE
    # Who the ids are recorded for (default: the queue).  Consumers of several
    # queues that form one logical consumer (consistent-hash shards) share one name.
    consumer_name: str | None = None
    prefetch: int = 10
    max_attempts: int = 5
    retry_delay: float = 0.1
    retry_delay_max: float = 5.0
    inbox_retention: float = 7 * 86400.0
    prune_interval: float = 60.0
    # (exchange, binding key) pairs: declare the queue and bind it at start-up.
    bindings: tuple[tuple[str, str], ...] = ()
    backoff_initial: float = 0.2
    backoff_max: float = 30.0
    connect_timeout: float = 10.0
    heartbeat: int = 60

    def __post_init__(self) -> None:
        if not self.queue:
            raise ValueError("give the queue to consume (--queue / OUTBOX_QUEUE)")
        if not _TABLE_NAME.match(self.inbox_table):
            raise ValueError(
                f"inbox table name {self.inbox_table!r} is not valid: use lower-case letters, "
                "digits and underscores, at most 41 characters, not starting with a digit"
            )
        if self.prefetch < 1:
            raise ValueError("prefetch must be at least 1")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.inbox_retention <= 0:
            raise ValueError("inbox_retention must be positive")

    @property
    def consumer(self) -> str:
        return self.consumer_name or self.queue


@dataclasses.dataclass
class ConsumerStats:
    handled: int = 0
    duplicates_skipped: int = 0
    handler_failures: int = 0
    retried: int = 0
    parked: int = 0
    reconnects: int = 0
    pruned: int = 0
    handler_seconds: Durations = dataclasses.field(default_factory=Durations)
    last_progress: float = dataclasses.field(default_factory=time.monotonic)
    last_error: str | None = None


class Outcome(enum.Enum):
    HANDLED = "handled"  # effect committed: ack
    DUPLICATE = "duplicate"  # id already in the inbox: ack, no effect
    RETRY = "retry"  # handler failed: requeue after a delay
    PARKED = "parked"  # given up (or no message id): ack, row in <inbox>_parked


def retry_delay(
    attempts: int, settings: ConsumerSettings, rng: random.Random | None = None
) -> float:
    """Seconds to hold a failed message before requeueing it (pure, capped)."""
    return backoff.delay(
        max(0, attempts - 1),
        initial=settings.retry_delay,
        maximum=settings.retry_delay_max,
        rng=rng,
    )


# -- one message's life -----------------------------------------------------------------
class Processor:
    """Apply one message through the inbox; no broker I/O.  Returns the outcome and,
    for ``RETRY``, how long to wait before requeueing.  ``DatabaseUnavailable``
    means: do not ack; the message comes back and the inbox decides then."""

    def __init__(
        self,
        store: InboxStore,
        handler: Handler,
        settings: ConsumerSettings,
        stats: ConsumerStats,
    ) -> None:
        self.store, self.handler, self.settings, self.stats = store, handler, settings, stats

    def process_batch(self, messages: Sequence[InboxMessage]) -> list[tuple[Outcome, float]]:
        """Apply messages that are already here in ONE transaction (one commit for
        all, which is what makes a busy consumer fast); if any of them fails, apply
        them one by one instead, so a failing message costs only itself."""
        identified = [m for m in messages if m.message_id is not None]
        if len(identified) < 2:
            return [self.process(m) for m in messages]
        try:
            applied = iter(
                self.store.apply_many(
                    [(str(m.message_id), self._effect(m), m.redelivered) for m in identified]
                )
            )
        except HandlerFailed as failed:
            emit(log, "consumer.batch_split", logging.DEBUG, size=len(messages), error=failed)
            return [self.process(m) for m in messages]
        return [
            self.process(m) if m.message_id is None else self._applied(m, next(applied))
            for m in messages
        ]

    def process(self, message: InboxMessage) -> tuple[Outcome, float]:
        """Apply one message in its own transaction."""
        if message.message_id is None:
            self.store.park(parking_for(message, "no message_id: cannot be deduplicated"))
            self.stats.parked += 1
            emit(log, "consumer.parked", logging.WARNING, reason="no message_id")
            return Outcome.PARKED, 0.0
        message_id = message.message_id
        try:
            applied = self.store.apply(
                message_id, self._effect(message), had_failed=message.redelivered
            )
        except HandlerFailed as failed:
            return self._failed(message, message_id, failed)
        return self._applied(message, applied)

    def _effect(self, message: InboxMessage) -> Callable[[psycopg.Connection[Any]], None]:
        def effect(conn: psycopg.Connection[Any]) -> None:
            started = time.perf_counter()
            try:
                self.handler(conn, message)
            finally:
                self.stats.handler_seconds.observe(time.perf_counter() - started)

        return effect

    def _applied(self, message: InboxMessage, applied: bool) -> tuple[Outcome, float]:
        if applied:
            self.stats.handled += 1
            return Outcome.HANDLED, 0.0
        self.stats.duplicates_skipped += 1
        emit(log, "consumer.duplicate_skipped", logging.DEBUG, message_id=message.message_id)
        return Outcome.DUPLICATE, 0.0

    def _failed(
        self, message: InboxMessage, message_id: str, failed: HandlerFailed
    ) -> tuple[Outcome, float]:
        self.stats.handler_failures += 1
        failure = self.store.record_failure(
            message_id,
            failed.description,
            max_attempts=self.settings.max_attempts,
            parking=parking_for(message, failed.description),
        )
        if failure.duplicate:
            self.stats.duplicates_skipped += 1
            return Outcome.DUPLICATE, 0.0
        if failure.parked:
            self.stats.parked += 1
            emit(
                log,
                "consumer.parked",
                logging.ERROR,
                message_id=message_id,
                attempts=failure.attempts,
                error=failed.description,
            )
            return Outcome.PARKED, 0.0
        delay = retry_delay(failure.attempts, self.settings)
        emit(
            log,
            "consumer.handler_failed",
            logging.WARNING,
            message_id=message_id,
            attempt=failure.attempts,
            retry_in=f"{delay:.2f}s",
            error=failed.description,
        )
        return Outcome.RETRY, delay


# -- the process ----------------------------------------------------------------------------
class Inbox:
    """A consumer with exactly-once effects: ``start()``, then ``run()`` until
    ``stop()`` (or SIGTERM/SIGINT with ``install_signal_handlers``)."""

    def __init__(self, handler: Handler, settings: ConsumerSettings) -> None:
        self.handler = handler
        self.settings = settings
        self.stats = ConsumerStats()
        self._stop = threading.Event()
        self.store: InboxStore | None = None
        self.processor: Processor | None = None
        self.broker = Broker(settings)
        self._next_prune = 0.0

    # -- control --------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: finish the message in hand, commit, ack, then return."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    # -- life -------------------------------------------------------------------
    def start(self) -> None:
        """Connect to both servers, creating the inbox tables if missing.  Raises
        ``DatabaseUnavailable``/``BrokerUnavailable`` (exit 3) or ``QueueMissing``."""
        if self.store is None:
            self._connect_database()
        if not self.broker.connected:
            self.broker.open()
        s = self.settings
        emit(
            log,
            "consumer.started",
            queue=s.queue,
            consumer=s.consumer,
            inbox=s.inbox_table,
            prefetch=s.prefetch,
        )

    def run(self) -> ConsumerStats:
        """Consume until stopped; outages are retried with backoff, never fatal."""
        if self.store is None:
            self.start()
        failures = 0
        while not self._stop.is_set():
            try:
                if self.store is None or self.store.broken:
                    self._connect_database()
                if not self.broker.connected:
                    self.broker.open()
                self._maybe_prune()
                deliveries = self.broker.drain(timeout=1.0)
                if deliveries:
                    self._handle(deliveries)
                self.stats.last_progress = time.monotonic()
                self.stats.last_error = None
                failures = 0
            except (DatabaseUnavailable, BrokerUnavailable, QueueMissing) as exc:
                self._outage(exc, failures)
                failures += 1
        self.broker.stop_consuming()
        self.close()
        emit(
            log,
            "consumer.stopped",
            handled=self.stats.handled,
            duplicates_skipped=self.stats.duplicates_skipped,
            parked=self.stats.parked,
        )
        return self.stats

    def close(self) -> None:
        self.broker.close()
        if self.store is not None:
            self.store.close()
            self.store = None

    def _outage(self, exc: OutboxError, failures: int) -> None:
        self.stats.reconnects += 1
        self.stats.last_error = exc.message
        self.stats.last_progress = time.monotonic()  # backing off is progress
        # Unacked messages go back to the queue; the inbox decides when they return.
        self.broker.close()
        if isinstance(exc, DatabaseUnavailable) and self.store is not None:
            self.store.close()
            self.store = None
        pause = backoff.delay(
            failures, initial=self.settings.backoff_initial, maximum=self.settings.backoff_max
        )
        emit(log, "consumer.retry", logging.WARNING, error=exc.message, retry_in=f"{pause:.2f}s")
        self._stop.wait(pause)

    def _connect_database(self) -> None:
        s = self.settings
        store = InboxStore(s.dsn, s.inbox_table, s.consumer, connect_timeout=s.connect_timeout)
        try:
            store.ensure_schema()
        except Exception:
            store.close()
            raise
        self.store = store
        self.processor = Processor(store, self.handler, s, self.stats)

    def _maybe_prune(self) -> None:
        now = time.monotonic()
        if now < self._next_prune or self.store is None:
            return
        batch, max_batches = 1000, 10
        deleted = self.store.prune(
            self.settings.inbox_retention, batch=batch, max_batches=max_batches
        )
        self.stats.pruned += deleted
        if deleted:
            emit(log, "consumer.pruned", rows=deleted)
        # A full pass means more is waiting: come back soon, between messages.
        full = deleted >= batch * max_batches
        self._next_prune = now + (1.0 if full else self.settings.prune_interval)

    # -- the deliveries in hand -----------------------------------------------------
    def _handle(self, deliveries: list[Any]) -> None:
        """Apply, then settle: ack what committed (or was skipped or parked); hold
        failed ones for their retry delay and put them back on the queue."""
        processor = self.processor
        if processor is None:
            raise DatabaseUnavailable("not connected to the consumer's PostgreSQL")
        messages = [
            to_inbox_message(d.body, d.properties, d.delivery_info, self.settings.queue)
            for d in deliveries
        ]
        outcomes = processor.process_batch(messages)
        if any(outcome is Outcome.HANDLED for outcome, _ in outcomes):
            faults.reached("consume_after_commit")
        settled = list(zip(deliveries, outcomes, strict=True))
        retries = [(d, delay) for d, (outcome, delay) in settled if outcome is Outcome.RETRY]
        if not retries:
            # Every earlier delivery is settled already: one frame acks the batch.
            self.broker.settle(deliveries[-1], ack=True, multiple=True)
        else:
            for delivery, (outcome, _) in settled:
                if outcome is not Outcome.RETRY:
                    self.broker.settle(delivery, ack=True)
            self.stats.retried += len(retries)
            self._stop.wait(max(delay for _, delay in retries))  # a stop cuts it short
            for delivery, _ in retries:
                self.broker.settle(delivery, ack=False)
        self.stats.last_progress = time.monotonic()


def consume(
    handler: Handler,
    *,
    queue: str,
    dsn: str = DEFAULT_DSN,
    amqp_url: str = DEFAULT_AMQP_URL,
    install_signal_handlers: bool = True,
    **options: Any,
) -> ConsumerStats:
    """Consume ``queue`` with exactly-once effects until SIGTERM/SIGINT.

    ``handler(conn, message)`` runs inside the transaction that records the
    message id; it must not commit.  ``options`` are ``ConsumerSettings`` fields.
    """
    inbox = Inbox(handler, ConsumerSettings(queue=queue, dsn=dsn, amqp_url=amqp_url, **options))
    if install_signal_handlers:
        inbox.install_signal_handlers()
    try:
        inbox.start()
        return inbox.run()
    finally:
        inbox.close()


def parse_bindings(texts: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``EXCHANGE:BINDING_KEY`` pairs (the key may contain ':'; '#' if omitted)."""
    pairs = []
    for text in texts:
        exchange, _, key = text.partition(":")
        if not exchange:
            raise ValueError(f"{text!r} is not EXCHANGE:BINDING_KEY (e.g. orders:order.*)")
        pairs.append((exchange, key or "#"))
    return tuple(pairs)
