"""A message whose handler kills the process (a segfault, the OOM killer,
``os._exit``) on in-memory fakes: redelivered messages are applied alone with
their attempt committed before the call, so the killer, and only it, is parked
after ``--max-attempts`` counted deaths; the hot path writes nothing more."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from outbox.amqp.message import InboxMessage
from outbox.errors import DatabaseUnavailable
from outbox.inbox.planning import Disposition, Plan, plan
from outbox.inbox.settings import ConsumerSettings
from outbox.inbox.stats import ConsumerStats
from outbox.inbox.steps import Processor
from tests.unit.inbox.fakes import FakeConnection, FakeStore, message


# -- the decision (pure) -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("redelivered", "attempts", "max_attempts", "expected"),
    [
        (False, 0, 5, Plan.BATCH),  # a first delivery: the hot path, nothing read
        (False, 9, 5, Plan.BATCH),  # even with a count: it is never read there
        (True, 0, 5, Plan.ALONE),  # a restart or a first death: counted, applied alone
        (True, 4, 5, Plan.ALONE),
        (True, 5, 5, Plan.PARK),  # the attempts reached the limit: parked unseen
        (True, 6, 5, Plan.PARK),
        (True, 0, 1, Plan.ALONE),
        (True, 1, 1, Plan.PARK),
    ],
)
def test_plan__redelivered_messages_go_alone_until_their_attempts_reach_the_limit(
    redelivered: bool, attempts: int, max_attempts: int, expected: Plan
) -> None:
    assert plan(redelivered, attempts, max_attempts) is expected


# -- the steps -----------------------------------------------------------------------------
def ok(conn: FakeConnection, msg: InboxMessage) -> None:
    if msg.body == b"raise":
        raise RuntimeError("refused")
    conn.apply(str(msg.message_id))


def test_alone__the_hot_path_writes_nothing_before_the_batch() -> None:
    store = FakeStore()
    stats = ConsumerStats()
    Processor(store, ok, ConsumerSettings(queue="q"), stats).process_batch(
        [message("a"), message("b")]
    )
    assert store.journal == ["record_ids ['a', 'b']", "seal", "commit"]


def test_alone__redelivered_ones_after_the_batch_each_counted_before_its_call() -> None:
    store = FakeStore()
    stats = ConsumerStats()
    messages = [
        message("r1", redelivered=True),
        message("a"),
        message("r2", redelivered=True),
        message("b"),
    ]
    outcomes = Processor(store, ok, ConsumerSettings(queue="q"), stats).process_batch(messages)
    assert outcomes == [(Disposition.HANDLED, 0.0)] * 4
    assert store.journal == [
        "record_ids ['a', 'b']",
        "seal",
        "commit",
        "start_attempt r1",
        "record_ids ['r1']",
        "seal",
        "commit",
        "end_attempt r1",
        "start_attempt r2",
        "record_ids ['r2']",
        "seal",
        "commit",
        "end_attempt r2",
    ]
    # A success clears the count, as for a message that failed before.
    assert store.attempts == {} and store.locked == set()
    assert sorted(store.effects) == ["a", "b", "r1", "r2"]


def test_alone__a_redelivered_duplicate_is_skipped_without_a_write() -> None:
    store = FakeStore()
    store.inbox.add("r")
    p = Processor(store, ok, ConsumerSettings(queue="q"), ConsumerStats())
    assert p.process(message("r", redelivered=True)) == (Disposition.DUPLICATE, 0.0)
    assert store.journal == ["start_attempt r"] and store.attempts == {}


@pytest.mark.parametrize("max_attempts", [1, 2, 5])
def test_alone__a_handler_that_raises_counts_each_attempt_once(max_attempts: int) -> None:
    """First delivery counted by the failure, every redelivery before its call,
    and its failure then adds nothing: parked after exactly ``max_attempts`` calls."""
    calls: list[str] = []

    def raising(conn: FakeConnection, msg: InboxMessage) -> None:
        calls.append(str(msg.message_id))
        raise RuntimeError("refused")

    store = FakeStore()
    p = Processor(
        store,
        raising,
        ConsumerSettings(queue="q", max_attempts=max_attempts),
        p_stats := ConsumerStats(),
    )
    bad = message("bad")
    outcome = p.process_batch([bad])[0][0]
    while outcome is Disposition.RETRY:
        assert store.attempts == {"bad": len(calls)}
        outcome = p.process_batch([dataclasses.replace(bad, redelivered=True)])[0][0]
    assert outcome is Disposition.PARKED
    assert len(calls) == max_attempts == p_stats.handler_failures
    assert store.parked[0].error.startswith("RuntimeError: refused")
    assert store.attempts == {} and store.locked == set()


# -- deaths, simulated -----------------------------------------------------------------------
class Died(BaseException):
    """The process is gone: what was committed stays, the rest never happened."""


class Killing:
    """A consumer process on a fake database whose handler kills it on ``kill``
    bodies: ``deliver`` returns True when the process died (the store is then put
    back to what was committed at that moment, and a new process starts)."""

    def __init__(self, store: FakeStore, max_attempts: int) -> None:
        self.store = store
        self.settings = ConsumerSettings(queue="q", max_attempts=max_attempts, retry_delay=0.0)
        self.deaths = 0
        self.calls: dict[str, int] = {}
        self._snapshot: Any = None
        self.processor = self._process()

    def _process(self) -> Processor:
        return Processor(self.store, self._handler, self.settings, ConsumerStats())

    def _committed(self) -> Any:
        s = self.store
        return copy.deepcopy((s.inbox, s.effects, s.attempts, s.last_error, s.parked))

    def _handler(self, conn: FakeConnection, msg: InboxMessage) -> None:
        if self._snapshot is not None:  # dead: nothing after the death happens
            raise Died
        key = str(msg.message_id)
        self.calls[key] = self.calls.get(key, 0) + 1
        if msg.body == b"kill":
            self._snapshot = self._committed()
            raise Died
        conn.apply(key)

    def deliver(self, messages: list[InboxMessage]) -> list[tuple[Disposition, float]] | None:
        self._snapshot = None
        outcomes = self.processor.process_batch(messages)
        if self._snapshot is None:
            return outcomes
        s = self.store
        s.inbox, s.effects, s.attempts, s.last_error, s.parked = self._snapshot
        s.locked = set()  # the session ended
        s.reconnect()
        self.deaths += 1
        self.processor = self._process()
        return None


@pytest.mark.parametrize("max_attempts", [1, 3, 5])
@pytest.mark.parametrize("size", [1, 10, 100])
def test_killer__only_the_killer_is_parked_after_max_attempts_counted_deaths(
    max_attempts: int, size: int
) -> None:
    """A batch whose 37th message (or the middle one) kills the process comes back
    whole, redelivered: applied alone, the others commit once each and only the
    killer accumulates attempts."""
    killer = min(37, size // 2)
    messages = [message(f"m{i}", b"kill" if i == killer else b"ok") for i in range(size)]
    run = Killing(FakeStore(), max_attempts)
    outcomes = run.deliver(messages)
    rounds = 0
    while outcomes is None:
        rounds += 1
        assert rounds <= max_attempts + 1, "the killer is never parked"
        outcomes = run.deliver([dataclasses.replace(m, redelivered=True) for m in messages])
    store = run.store
    # The first death is in the batch, where nothing is counted; each later one was
    # counted before its call: max_attempts + 1 deaths in all, then parked unseen.
    assert run.deaths == max_attempts + 1 == run.calls[f"m{killer}"]
    assert [p.message_id for p in store.parked] == [f"m{killer}"]
    assert store.parked[0].error.startswith(
        f"redelivered {max_attempts} times, the outcome of the last attempt unknown"
    )
    assert "os._exit" in store.parked[0].error
    good = [f"m{i}" for i in range(size) if i != killer]
    assert sorted(store.effects) == sorted(good)  # one effect each
    assert store.inbox == {*good, f"m{killer}"}
    assert store.attempts == {} and store.locked == set()
    parked_at = outcomes[killer]
    assert parked_at == (Disposition.PARKED, 0.0)


def test_killer__after_a_raise_the_reason_keeps_the_last_error() -> None:
    store = FakeStore()
    store.attempts["k"], store.last_error["k"] = 2, "RuntimeError: refused"
    p = Processor(store, ok, ConsumerSettings(queue="q", max_attempts=2), ConsumerStats())
    assert p.process(message("k", redelivered=True)) == (Disposition.PARKED, 0.0)
    error = store.parked[0].error
    assert error.startswith("2 attempts failed or did not finish, the outcome of the last one")
    assert error.endswith("the last error recorded: RuntimeError: refused")
    assert store.effects == [] and store.inbox == {"k"} and store.attempts == {}


def test_killer__a_parked_and_retried_message_starts_counting_afresh() -> None:
    """``outbox parked retry`` removes the parked row, the id and the count, and
    sends a new message (not redelivered): it takes the batch path, and only its
    own new deaths count."""
    run = Killing(FakeStore(), max_attempts=2)
    killer = message("k", b"kill")
    assert run.deliver([killer]) is None
    while run.deliver([dataclasses.replace(killer, redelivered=True)]) is None:
        pass
    assert [p.message_id for p in run.store.parked] == ["k"] and run.deaths == 3
    # retry (release_parked, retried_parked): parked row, inbox id and attempts go;
    # published anew
    run.store.parked.clear()
    run.store.inbox.discard("k")
    run.store.attempts.pop("k", None)
    fixed = message("k", b"ok")  # the handler was fixed meanwhile
    assert run.deliver([fixed]) == [(Disposition.HANDLED, 0.0)]
    assert run.store.effects == ["k"] and run.store.parked == []


def refuse(conn: FakeConnection, msg: InboxMessage) -> None:
    raise RuntimeError("refused")


@pytest.mark.parametrize("redelivered", [True, False])
def test_alone__an_error_not_recorded_for_the_database_is_recorded_once_it_is_back(
    redelivered: bool,
) -> None:
    """A redelivered message's attempt is counted before its call: if the database
    goes away before its error is recorded, the error is owed and recorded later
    (the last attempt is then parked with its error, not as one without an
    outcome).  A first delivery's failure is not owed: its count may have
    committed before the connection was lost, and it must not count twice."""
    store = FakeStore()
    p = Processor(store, refuse, ConsumerSettings(queue="q", max_attempts=1), ConsumerStats())
    store.fail_next["record_failure"] = DatabaseUnavailable("lost")
    with pytest.raises(DatabaseUnavailable):
        p.process(message("k", redelivered=redelivered))
    assert len(p.owed) == (1 if redelivered else 0)
    p.settle_owed()
    if redelivered:
        [parked] = store.parked
        assert parked.message_id == "k" and parked.error.startswith("RuntimeError: refused")
        assert parked.error.endswith("(then the database was unreachable)")
    else:
        assert store.parked == [] and store.attempts == {}
    assert p.stats.handler_failures == 1


def test_metrics__parked_messages_are_counted_by_reason() -> None:
    """``outbox_consumer_parked_total{reason}`` tells a handler that kept failing
    (failed) from a last attempt without an outcome, the handler possibly killing
    the process (unfinished), and a message that cannot be deduplicated (unusable)."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from outbox.inbox.metrics import ConsumerCollector

    store = FakeStore()
    store.attempts["killer"] = 1
    stats = ConsumerStats()
    p = Processor(store, refuse, ConsumerSettings(queue="q", max_attempts=1), stats)
    assert p.process(message("failing")) == (Disposition.PARKED, 0.0)
    assert p.process(message("killer", redelivered=True)) == (Disposition.PARKED, 0.0)
    assert p.process(message(None)) == (Disposition.PARKED, 0.0)
    assert p.process(message("failing again")) == (Disposition.PARKED, 0.0)
    inbox = SimpleNamespace(stats=stats, broker=SimpleNamespace(connected=True))
    figure = SimpleNamespace(refresh=lambda: None, figures=None)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ConsumerCollector(inbox, figure))  # type: ignore[arg-type]
    [family] = [
        f
        for f in text_string_to_metric_families(generate_latest(registry).decode())
        if f.name == "outbox_consumer_parked"
    ]
    by_reason = {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}
    assert by_reason == {"failed": 2, "unfinished": 1, "unusable": 1}
    assert stats.parked == 4
