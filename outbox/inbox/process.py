"""The consumer process: connect, receive, settle, hold failed messages, reconnect, stop.

The steps of each message (one transaction of messages over the store port), the
exactly-once promise, the handler contract and the crash table are in
``outbox/inbox/steps.py``; the decisions they take are pure (``outbox/inbox/planning.py``).
This module is the process around them, as ``outbox/relay/process.py`` is the relay's:

- ``serve`` is the whole life, as ``outbox consume`` and ``consume()`` run it
  (``outbox.lifecycle``): the endpoints, ``start``, ``run``, ``close``, the summary;
- ``Inbox.start`` connects both servers, creating what is missing of the inbox
  tables (a catalog read when nothing is; otherwise short lock waits, retried and
  logged: ``consumer.schema_waiting``), and reads the queue's policy (a missing
  queue fails fast, a stream is refused);
- ``Inbox.run`` goes round: reconnect what is broken, prune the inbox now and then
  (``inbox_retention``), drain the deliveries that arrived, apply them through the
  ``Processor`` (on a queue that may drop a returned message, what the broker
  returned is taken into custody first and applied from there: ``_apply_custody``),
  settle them (ack what committed, was skipped or parked; hold a failed one in hand,
  unacked, for its retry delay, and one whose inbox row another transaction holds
  for ``row_held_delay``, the later messages of its ordering key behind it),
  apply again the held ones that are due (parked once they would be held past
  ``MAX_HOLD``), and subscribe again once the messages in hand take half the
  prefetch, up to ``HAND_MOST`` times it in hand (``_make_room``; on a quorum
  queue once the whole window is in hand, acks kept back meanwhile);
- an outage (a server lost, or a statement the server refused) closes both
  connections, so what was in hand goes back to the queue, backs off and
  reconnects; a queue refused (``QueueRefused``) ends the consumer;
- SIGTERM/SIGINT (``install_signal_handlers``) stop it once the messages in hand
  are settled.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from outbox import backoff, lifecycle
from outbox import fault_injection as faults
from outbox.amqp.consumer import Broker, QueueRefused, refuse
from outbox.amqp.policy import from_stream, may_subscribe_again
from outbox.config import DEFAULT_AMQP_URL, DEFAULT_DSN
from outbox.db.inbox import InboxStore, SchemaWait
from outbox.db.migrate import retry_pause
from outbox.errors import DatabaseUnavailable, OutboxError
from outbox.events import emit
from outbox.inbox import planning
from outbox.inbox.custody import may_drop_returned, restored, stored, to_take
from outbox.inbox.handlers import Handler
from outbox.inbox.metrics import ConsumerEndpoints
from outbox.inbox.planning import Disposition, Dispositions, Held, outcome_reason
from outbox.inbox.settings import ConsumerSettings
from outbox.inbox.stats import ConsumerStats
from outbox.inbox.steps import BrokerPort, Processor, StorePort

__all__ = ["Inbox", "consume", "serve"]

log = logging.getLogger("outbox.inbox")

# At most this many times ``--prefetch`` messages in hand, held for a retry or
# behind their key (``Inbox._make_room``).
HAND_MOST = 4
# Custody (``Inbox._apply_custody``): rows read at once, seconds of applying them
# before the socket is read again, how often custody is looked at when it seemed
# empty, and the shortest wait of a message in custody whose attempt did not finish.
CUSTODY_READ = 50
CUSTODY_PASS = 0.2
CUSTODY_CHECK = 5.0
CUSTODY_MIN_DELAY = 0.5


class Inbox:
    """A consumer with exactly-once effects: ``start()``, then ``run()`` until
    ``stop()`` (or SIGTERM/SIGINT with ``install_signal_handlers``)."""

    def __init__(
        self,
        handler: Handler,
        settings: ConsumerSettings,
        *,
        broker: BrokerPort | None = None,
        connect_store: Callable[[ConsumerSettings], StorePort] | None = None,
    ) -> None:
        self.handler = handler
        self.settings = settings
        self.stats = ConsumerStats()
        self._stop = threading.Event()
        self._signal_handlers = False
        self.store: StorePort | None = None
        self.processor: Processor | None = None
        self.broker: BrokerPort = broker if broker is not None else Broker(settings)
        self._connect_store = connect_store or _connect_store
        self._next_prune = 0.0
        # Failed messages waiting, unacked, for their next attempt (``_hold``), and
        # per ordering key of one of them, the later messages of that key.
        self._held: list[Held] = []
        self._behind: dict[str, list[Any]] = {}
        # When to read custody next (``_apply_custody``; at once at start-up: a
        # consumer may have died with messages in it).
        self._next_custody = 0.0

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
        # A KeyboardInterrupt inside a handler is then never Ctrl-C (see the policy).
        self._signal_handlers = True
        if self.processor is not None:
            self.processor.on_interrupt = None

    # -- life -------------------------------------------------------------------
    def start(self) -> None:
        """Connect to both servers, creating the inbox tables if missing.  Raises
        ``DatabaseUnavailable``/``BrokerUnavailable`` (exit 3) or ``QueueMissing``."""
        if self.store is None:
            self._connect_database()
        if not self.broker.connected:
            self.broker.open()
        self._adopt_policy()
        self._maybe_prune()
        s = self.settings
        emit(
            log,
            "consumer.started",
            queue=s.queue,
            consumer=s.consumer,
            inbox=s.inbox_table,
            prefetch=s.prefetch,
            batch=s.batch_size,
            queue_policy=self.broker.policy.describe(),
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
                    self._adopt_policy()
                self._maybe_prune()
                deliveries = self.broker.drain(timeout=self._drain_timeout())
                if deliveries:
                    self._handle(deliveries)
                self._retry_due()
                self._apply_custody()
                self._make_room()
                self.stats.last_progress = time.monotonic()
                self.stats.last_error = None
                failures = 0
            except QueueRefused:
                raise
            except OutboxError as exc:  # an outage, or a statement the server refused
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
        # Those held for a retry too: their deliveries end with the channel.
        self.broker.close()
        self._held, self._behind = [], {}
        # A new session as well, also after a refused statement: one of the consumer's
        # own statements fails on a session whose settings a handler changed for good
        # (a plain SET search_path that committed); a new session starts clean.
        if self.store is not None:
            self.store.close()
            self.store = None
        pause = backoff.delay(
            failures, initial=self.settings.backoff_initial, maximum=self.settings.backoff_max
        )
        emit(log, "consumer.retry", logging.WARNING, error=exc.message, retry_in=f"{pause:.2f}s")
        self._stop.wait(pause)

    def _connect_database(self) -> None:
        store = self._connect_store(self.settings)
        try:
            store.ensure_schema(self._schema_wait)
        except Exception:
            store.close()
            raise
        self.store = store
        if self.processor is None:
            self.processor = Processor(
                store,
                self.handler,
                self.settings,
                self.stats,
                on_interrupt=None if self._signal_handlers else self.stop,
            )
            self.processor.policy = self.broker.policy
        else:  # the same processor: it may owe attempts from before the outage
            self.processor.store = store

    def _schema_wait(self, blocked: SchemaWait) -> None:
        """A missing piece of the inbox's schema waits for a lock held by another
        transaction: say what it waits for, pause, and try again (unless stopped)."""
        emit(
            log,
            "consumer.schema_waiting",
            logging.WARNING,
            missing=", ".join(blocked.missing),
            attempt=blocked.attempt,
            waited=f"{blocked.waited:.1f}s",
            waiting_for=blocked.describe(),
        )
        if self._stop.wait(retry_pause(blocked.attempt)):
            raise DatabaseUnavailable("stopped while waiting to create the inbox tables")

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
    def _adopt_policy(self) -> None:
        if self.processor is not None:
            self.processor.policy = self.broker.policy

    def _handle(self, deliveries: Sequence[Any]) -> None:
        """Apply, then settle: ack what committed (or was skipped or parked); keep
        failed ones in hand for their next attempt (``_hold``).  A message of an
        ordering key whose earlier message waits for a retry waits behind it.  On a
        queue that may drop a returned message, those the broker returned are taken
        into custody first (``_take_custody``)."""
        processor = self.processor
        if processor is None:
            raise DatabaseUnavailable("not connected to the consumer's PostgreSQL")
        policy = self.broker.policy
        if not policy.queue_type and any(from_stream(d.message.headers) for d in deliveries):
            # A stream that the start-up check could not see (no configure permission).
            raise refuse(self.settings.queue, "its deliveries come from a stream")
        if not self._behind and not may_drop_returned(policy):  # the hot path
            with self.broker.busy():
                outcomes = processor.process_batch([d.message for d in deliveries])
            self._settle(deliveries, outcomes)
            self.stats.last_progress = time.monotonic()
            return
        if may_drop_returned(policy):
            deliveries = self._take_custody(deliveries)
            if not deliveries:
                return
        ready: list[Any] = []
        for delivery in deliveries:
            key = delivery.message.ordering_key
            if key is not None and key in self._behind:
                self._behind[key].append(delivery)
            else:
                ready.append(delivery)
        if ready:
            with self.broker.busy():
                outcomes = processor.process_batch([d.message for d in ready])
            self._settle(ready, outcomes)
        self.stats.last_progress = time.monotonic()

    def _take_custody(self, deliveries: Sequence[Any]) -> list[Any]:
        """Store the deliveries that need custody (``custody.to_take``) in
        ``<inbox>_custody``, in one transaction, and ack each once it committed;
        the others are returned, to be applied as usual.  Before any handler runs:
        from here on a crash costs them nothing."""
        policy = self.broker.policy
        store = self.store
        if store is None:
            raise DatabaseUnavailable("not connected to the consumer's PostgreSQL")
        chosen = to_take(
            [d.message for d in deliveries],
            policy,
            held=self.stats.custody_held > 0,
            waiting_keys=self._behind.keys(),
        )
        if not any(chosen):
            return list(deliveries)
        taken = [d for d, take in zip(deliveries, chosen, strict=True) if take]
        store.take_custody(self.settings.queue, [stored(d.message) for d in taken])
        faults.reached("consume_after_custody")
        for delivery in taken:
            # One by one: a multiple ack would also ack earlier deliveries in hand.
            self.broker.settle(delivery, ack=True)
        self.stats.custody_taken += len(taken)
        self.stats.custody_held += len(taken)
        self._next_custody = 0.0  # apply them at once
        emit(log, "consumer.custody_taken", logging.DEBUG, messages=len(taken))
        return [d for d, take in zip(deliveries, chosen, strict=True) if not take]

    def _apply_custody(self) -> None:
        """Apply messages in custody (``outbox.inbox.custody``), oldest first, each
        alone with its attempt counted first, for at most ``CUSTODY_PASS`` seconds:
        then the loop reads the socket again, so that what arrives meanwhile is
        taken into custody without waiting for the whole table.  A failed one waits
        in the table for its retry delay (its key with it); one parked, or found
        applied already (a copy), leaves it.  Custody is read again at once while it
        holds messages, and every ``CUSTODY_CHECK`` seconds when it seemed empty
        (another consumer of the same name may have died with messages in it)."""
        store, processor = self.store, self.processor
        now = time.monotonic()
        if store is None or processor is None or now < self._next_custody:
            return
        found = store.next_in_custody(CUSTODY_READ)
        self.stats.custody_held = found.held
        started = time.monotonic()
        for applied, row in enumerate(found.due):
            if applied and time.monotonic() - started >= CUSTODY_PASS:
                break
            _id, message_id, queue, exchange, routing_key, body, raw = row
            message = restored(
                queue=queue,
                exchange=exchange,
                routing_key=routing_key,
                body=body,
                raw_properties=raw,
            )
            with self.broker.busy():
                outcome, delay = processor.process(message)
            if outcome in (Disposition.RETRY, Disposition.HELD):
                # Failed, or its inbox row held by another transaction: it waits here.
                store.delay_custody(message_id, max(delay, CUSTODY_MIN_DELAY))
            elif outcome in (Disposition.PARKED, Disposition.DUPLICATE):
                store.release_custody(message_id)  # its id is in the inbox now
        if found.due:
            self._next_custody = 0.0
        elif found.held:
            wait = found.next_in if found.next_in is not None else CUSTODY_CHECK
            self._next_custody = now + min(max(wait, 0.0), CUSTODY_CHECK)
        else:
            self._next_custody = now + CUSTODY_CHECK

    def _settle(
        self, deliveries: Sequence[Any], outcomes: Dispositions, *, multiple: bool = True
    ) -> None:
        """Ack, hold or put behind each delivery by its outcome.  ``multiple``: every
        delivery before these is settled already (one frame may ack them all)."""
        if any(outcome is Disposition.HANDLED for outcome, _ in outcomes):
            faults.reached("consume_after_commit")
        settled = list(zip(deliveries, outcomes, strict=True))
        if (
            multiple
            and not self._held
            and all(
                o in (Disposition.HANDLED, Disposition.DUPLICATE, Disposition.PARKED)
                for o, _ in outcomes
            )
        ):
            # Every earlier delivery is settled already: one frame acks the batch.
            self.broker.settle(deliveries[-1], ack=True, multiple=True)
            return
        for delivery, (outcome, delay) in settled:
            if outcome in (Disposition.RETRY, Disposition.HELD):
                self._hold(delivery, delay, row_held=outcome is Disposition.HELD)
            elif outcome is Disposition.BEHIND:
                self._behind[delivery.message.ordering_key].append(delivery)
            else:
                self.broker.settle(delivery, ack=True)
                self._release(delivery)

    def _hold(self, delivery: Any, delay: float, *, row_held: bool = False) -> None:
        """Keep a failed message in hand, unacked, until its next attempt, while the
        others go on.  Nothing goes back to the queue: no delivery is counted
        against a quorum queue's limit, no TTL runs, and the message keeps its
        place.  Its ordering key, if any, waits with it.  ``row_held``: not failed,
        its inbox row is held by another transaction (``Disposition.HELD``): it
        waits ``row_held_delay``, each try costing one short lock wait."""
        now = time.monotonic()
        previous = next((h for h in self._held if h.delivery is delivery), None)
        since = previous.since if previous is not None else now
        if row_held:
            delay = planning.row_held_delay(now - since, self.settings)
        self._held = [h for h in self._held if h.delivery is not delivery]
        self._held.append(Held(delivery, now + delay, since))
        self.stats.retried += 1
        key = delivery.message.ordering_key
        if key is not None:
            self._behind.setdefault(key, [])

    def _release(self, delivery: Any) -> None:
        """``delivery`` is settled: the messages of its key waiting behind it go on."""
        key = delivery.message.ordering_key
        if key is None or key not in self._behind:
            return
        if any(h.delivery.message.ordering_key == key for h in self._held):
            return
        waiting = self._behind.pop(key)
        if waiting:
            self._handle(waiting)

    def _drain_timeout(self) -> float:
        now = time.monotonic()
        due = [h.due for h in self._held]
        if self.stats.custody_held:
            due.append(self._next_custody)
        if not due:
            return 1.0
        return min(1.0, max(0.0, min(due) - now))

    def _make_room(self) -> None:
        """Messages held for a retry, or waiting behind one of their key, take
        slots of the subscription's ``--prefetch``: once they take half of them,
        a new subscription with a fresh window (``Broker.resubscribe``), so that
        the healthy messages behind them keep coming.  On a quorum queue a cancel
        hands back what is on its way to the subscription
        (``planning.cancel_returns_deliveries``): there the consumer first keeps
        back the acks of the subscription's messages (``Broker.hold_acks``) until
        its whole window is in hand, so that nothing is on its way, then
        subscribes again and acks them.  At most ``HAND_MOST`` times
        ``--prefetch`` messages unacked (their bodies are in memory): with a hand
        that full the consumer waits for the first retry, as with a full prefetch.
        Never on a queue with a single active consumer (``may_subscribe_again``)."""
        waiting = [h.delivery for h in self._held]
        waiting += [d for behind in self._behind.values() for d in behind]
        policy, broker = self.broker.policy, self.broker
        mine = sum(1 for delivery in waiting if broker.subscribed(delivery))
        if not (
            waiting
            and may_subscribe_again(policy)
            and planning.room_to_subscribe(len(waiting), mine, self.settings.prefetch, HAND_MOST)
        ):
            broker.release_acks()
            return
        if planning.cancel_returns_deliveries(policy) and not broker.window_in_hand():
            broker.hold_acks()
            return
        broker.resubscribe()
        emit(log, "consumer.resubscribed", in_hand=len(waiting), prefetch=self.settings.prefetch)

    def _retry_due(self) -> None:
        """The next attempt of each held message whose delay is over (on a stop,
        those still held go back to the queue when the channel closes)."""
        processor = self.processor
        if processor is None:
            return
        now = time.monotonic()
        due = [h for h in self._held if h.due <= now]
        if due:
            # Other messages' handlers ran on the session since these failed: what
            # they left in it for good must not fail them again.
            processor.renew_session()
        for held in due:
            delivery = held.delivery
            with self.broker.busy():
                outcome = processor.process_batch([delivery.message])[0]
                if (
                    outcome[0] is Disposition.RETRY
                    and now + outcome[1] - held.since > planning.MAX_HOLD
                ):
                    outcome = processor.give_up(delivery.message, outcome_reason(held, now))
            # A message whose row is held is never given up here: parking it would
            # record its id, which is what the other transaction holds.
            if outcome[0] in (Disposition.RETRY, Disposition.HELD):
                self._hold(delivery, outcome[1], row_held=outcome[0] is Disposition.HELD)
                continue
            self._held.remove(held)
            self.broker.settle(delivery, ack=True)
            self._release(delivery)


def _connect_store(settings: ConsumerSettings) -> InboxStore:
    return InboxStore(
        settings.dsn,
        settings.inbox_table,
        settings.consumer,
        connect_timeout=settings.connect_timeout,
    )


def serve(
    inbox: Inbox,
    *,
    metrics_port: int = 0,
    metrics_address: str = "0.0.0.0",
    run: Callable[[], ConsumerStats] | None = None,
) -> ConsumerStats:
    """What ``outbox consume`` and ``consume()`` run (``outbox.lifecycle.serve``): the
    endpoints on ``metrics_port`` (0: none), ``start``, ``run`` until stopped,
    ``close``, and the ``consumer.summary`` event.  Signals are the caller's.

    ``run``: what starts and runs the consumer instead of ``inbox.start`` and
    ``inbox.run`` (an async handler's, ``outbox.inbox.aio.run_async`` on the
    command's event loop, which starts the inbox on a thread of its own)."""

    def endpoints() -> ConsumerEndpoints:
        return ConsumerEndpoints(inbox, port=metrics_port, address=metrics_address)

    def summary(stats: ConsumerStats) -> dict[str, int]:
        return {
            "handled": stats.handled,
            "duplicates_skipped": stats.duplicates_skipped,
            "handler_failures": stats.handler_failures,
            "parked": stats.parked,
        }

    return lifecycle.serve(
        "consumer",
        start=inbox.start if run is None else lambda: None,
        run=inbox.run if run is None else run,
        close=inbox.close,
        endpoints=endpoints if metrics_port else None,
        stopped="consumer.summary",
        summary=summary,
    )


def consume(
    handler: Handler,
    *,
    queue: str,
    dsn: str = DEFAULT_DSN,
    amqp_url: str = DEFAULT_AMQP_URL,
    install_signal_handlers: bool = True,
    metrics_port: int = 0,
    metrics_address: str = "0.0.0.0",
    **options: Any,
) -> ConsumerStats:
    """Consume ``queue`` with exactly-once effects until SIGTERM/SIGINT, as
    ``outbox consume`` does (``serve``), with ``/metrics``, ``/healthz`` and ``/readyz``
    on ``metrics_port`` when it is not 0.

    ``handler(conn, message)`` runs inside the transaction that records the
    message id; it must not commit.  ``options`` are ``ConsumerSettings`` fields.
    """
    inbox = Inbox(handler, ConsumerSettings(queue=queue, dsn=dsn, amqp_url=amqp_url, **options))
    if install_signal_handlers:
        inbox.install_signal_handlers()
    return serve(inbox, metrics_port=metrics_port, metrics_address=metrics_address)
