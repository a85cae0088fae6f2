"""A message whose inbox row another transaction holds (``InboxRowHeld``) goes back
to the queue without an attempt counted or a handler called; the others go on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outbox.inbox.message import InboxMessage
from outbox.inbox.planning import Disposition
from outbox.inbox.settings import ConsumerSettings
from outbox.inbox.stats import ConsumerStats
from outbox.inbox.steps import Processor
from outbox.inbox.store import InboxRowHeld, Started
from tests.unit.inbox.fakes import FakeStore, message


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


def test_held__the_held_message_is_put_back_uncounted_and_the_batch_is_applied() -> None:
    store = HeldStore({"m1"})
    calls: list[str] = []

    def handler(conn: Any, msg: InboxMessage) -> None:
        calls.append(str(msg.message_id))
        record(conn, msg)

    stats = ConsumerStats()
    processor = Processor(store, handler, ConsumerSettings(queue="q", max_attempts=1), stats)
    outcomes = processor.process_batch([message(f"m{i}") for i in range(3)])
    assert [d for d, _ in outcomes] == [Disposition.HANDLED, Disposition.RETRY, Disposition.HANDLED]
    assert sorted(store.inbox) == ["m0", "m2"] and "m1" not in calls
    assert store.attempts == {} and store.parked == [] and stats.handler_failures == 0


def test_held__a_redelivered_held_message_comes_back_as_often_as_it_takes_uncounted() -> None:
    store = HeldStore({"m"})
    stats = ConsumerStats()
    processor = Processor(store, record, ConsumerSettings(queue="q", max_attempts=2), stats)
    again = message("m", redelivered=True)
    for _ in range(5):  # more than --max-attempts: never parked while it is held
        assert processor.process_batch([again]) == [(Disposition.RETRY, 0.0)]
    assert store.attempts == {} and store.parked == [] and store.locked == set()
    store.held.clear()  # the holder committed (the id is not in the inbox): applied
    assert processor.process_batch([again]) == [(Disposition.HANDLED, 0.0)]
    assert store.inbox == {"m"} and stats.handler_failures == 0
