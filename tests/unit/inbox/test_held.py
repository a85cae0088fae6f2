"""A message whose inbox row another transaction holds (``InboxRowHeld``) is set
aside (``HELD``: kept in hand, tried again later) without an attempt counted or a
handler called; the others go on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from outbox.amqp.message import InboxMessage
from outbox.db.inbox import InboxRowHeld, Started
from outbox.inbox.planning import ROW_HELD_DELAY_MAX, Disposition, row_held_delay
from outbox.inbox.process import Inbox
from outbox.inbox.settings import ConsumerSettings
from outbox.inbox.stats import ConsumerStats
from outbox.inbox.steps import Processor
from tests.unit.inbox.fakes import FakeBroker, FakeStore, message
from tests.unit.inbox.test_loop import act, passes


class HeldStore(FakeStore):
    """Rows of ``held`` ids are held by someone else: recording or counting them
    gives up (as after the session's lock_timeout), writing nothing."""

    def __init__(self, held: set[str]) -> None:
        super().__init__()
        self.held = held

    def _give_up_on(self, keys: Sequence[str]) -> None:
        if self.held.intersection(keys):
            raise InboxRowHeld("gave up waiting for a lock", "")

    def record_ids(self, keys: Sequence[str], redelivered: Sequence[str]) -> tuple[int, set[str]]:
        self._give_up_on(keys)
        return super().record_ids(keys, redelivered)

    def start_attempt(self, message_id: str, *, max_attempts: int) -> Started:
        self._give_up_on([message_id])
        return super().start_attempt(message_id, max_attempts=max_attempts)


def record(conn: Any, msg: InboxMessage) -> None:
    conn.apply(str(msg.message_id))


def test_held__the_held_message_is_set_aside_uncounted_and_the_batch_is_applied() -> None:
    store = HeldStore({"m1"})
    calls: list[str] = []

    def handler(conn: Any, msg: InboxMessage) -> None:
        calls.append(str(msg.message_id))
        record(conn, msg)

    stats = ConsumerStats()
    processor = Processor(store, handler, ConsumerSettings(queue="q", max_attempts=1), stats)
    outcomes = processor.process_batch([message(f"m{i}") for i in range(3)])
    assert [d for d, _ in outcomes] == [Disposition.HANDLED, Disposition.HELD, Disposition.HANDLED]
    assert sorted(store.inbox) == ["m0", "m2"] and "m1" not in calls
    assert store.attempts == {} and store.parked == [] and stats.handler_failures == 0


def test_held__a_redelivered_held_message_comes_back_as_often_as_it_takes_uncounted() -> None:
    store = HeldStore({"m"})
    stats = ConsumerStats()
    processor = Processor(store, record, ConsumerSettings(queue="q", max_attempts=2), stats)
    again = message("m", redelivered=True)
    for _ in range(5):  # more than --max-attempts: never parked while it is held
        assert processor.process_batch([again]) == [(Disposition.HELD, 0.0)]
    assert store.attempts == {} and store.parked == [] and store.locked == set()
    store.held.clear()  # the holder committed (the id is not in the inbox): applied
    assert processor.process_batch([again]) == [(Disposition.HANDLED, 0.0)]
    assert store.inbox == {"m"} and stats.handler_failures == 0


def test_row_held_delay__as_long_again_as_held_so_far_from_the_retry_delay_to_a_cap() -> None:
    settings = ConsumerSettings(queue="q", retry_delay=0.1, retry_delay_max=0.2)
    assert row_held_delay(0.0, settings) == 0.1
    assert row_held_delay(0.8, settings) == 0.8  # not capped by --retry-delay-max
    assert row_held_delay(60.0, settings) == ROW_HELD_DELAY_MAX


def test_inbox__a_held_row_is_set_aside_with_its_key_while_the_others_are_applied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The held message stays in hand, unacked and uncounted, its key's later
    message behind it, the others applied; tried again after ``row_held_delay``
    (0 here; never given up, never requeued), it is applied once the row is free."""
    from outbox.inbox import planning

    monkeypatch.setattr(planning, "ROW_HELD_DELAY_MAX", 0.0)
    monkeypatch.setattr(planning, "MAX_HOLD", 0.0)  # a failed one would be parked by now
    store = HeldStore({"k1"})
    keyed = {"x-ordering-key": "k"}
    broker = FakeBroker(
        [
            message("k1", b"ok", headers=keyed, ordering_key="k"),
            message("a", b"ok"),
            message("k2", b"ok", headers=keyed, ordering_key="k"),
            message("b", b"ok"),
        ]
    )
    settings = ConsumerSettings(queue="q", max_attempts=1, retry_delay=0.0, retry_delay_max=0.0)
    inbox = Inbox(act, settings, broker=broker, connect_store=lambda _: store)
    inbox.start()
    for _ in range(5):  # more than --max-attempts: never parked while it is held
        passes(inbox, broker, 1)
    assert store.effects == ["a", "b"]
    assert [d.message.message_id for d in broker.unacked] == ["k1", "k2"]
    assert store.attempts == {} and store.parked == [] and inbox.stats.handler_failures == 0
    assert all(not j.startswith("reject") for j in broker.journal)
    store.held.clear()  # the holder rolled back
    passes(inbox, broker, 3)
    assert store.effects == ["a", "b", "k1", "k2"] and broker.unacked == []


class HeldAtRecord(HeldStore):
    """The attempt lock is free, the inbox row held (a first delivery of the id in
    flight in another consumer's transaction): ``start_attempt`` counts, then the
    record step gives up."""

    def start_attempt(self, message_id: str, *, max_attempts: int) -> Started:
        return FakeStore.start_attempt(self, message_id, max_attempts=max_attempts)


def test_held__a_redelivered_message_held_at_its_record_step_takes_its_count_back() -> None:
    store = HeldAtRecord({"m"})
    stats = ConsumerStats()
    processor = Processor(store, record, ConsumerSettings(queue="q", max_attempts=2), stats)
    again = message("m", redelivered=True)
    for _ in range(5):  # more than --max-attempts: no count left, never parked unseen
        assert processor.process_batch([again]) == [(Disposition.HELD, 0.0)]
        assert store.attempts.get("m", 0) == 0 and store.locked == set()
    assert store.parked == []
    store.held.clear()
    assert processor.process_batch([again]) == [(Disposition.HANDLED, 0.0)]
    assert store.inbox == {"m"}
