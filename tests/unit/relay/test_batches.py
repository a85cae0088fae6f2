"""The batch loop against in-memory fakes of the store and the broker: the schedule at
depth 1 and 2, every crash point of the crash table, and every failure path.

The same cases run against the real servers in ``tests/integration/relay/test_faults_*.py``;
these run in milliseconds and say exactly which step went wrong.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, cast

import pytest

from outbox import fault_injection as faults
from outbox.config import Settings
from outbox.errors import (
    BrokerBlocked,
    BrokerUnavailable,
    DatabaseRefused,
    DatabaseUnavailable,
    DeadLettersUnwritable,
    OutboxError,
    OutcomeUnknown,
    PreparedSlotsExhausted,
    StatementTimedOut,
)
from outbox.message import DeadLetter, OutboxRow
from outbox.relay.batches import Batches, BatchStorePort, BrokerPort, State
from outbox.relay.stats import Stats
from resolver.decide import Action, Owner, decide
from tests.fixtures.fakes import FakeBroker, FakeStore, Journal, Routing, make_rows

BATCH = 10


class Crashed(Exception):
    """The relay process 'died' at an armed crash point."""


@pytest.fixture(autouse=True)
def _crashes_raise(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def crash() -> None:
        raise Crashed

    monkeypatch.setattr(faults, "crash", crash)
    yield
    faults.disarm()


def make_batches(
    store: FakeStore,
    broker: FakeBroker,
    *,
    depth: int,
    relay_id: str = "r1",
    may_commit: bool = True,
) -> Batches:
    settings = Settings(batch_size=BATCH, pipeline=depth == 2, ledger_queue="ledger")
    batches = Batches(settings, broker, Stats(), may_commit=lambda: may_commit)
    batches.store = store
    batches.relay_id = relay_id
    return batches


def drain(batches: Batches) -> None:
    while batches.step():
        pass
    batches.finish_in_flight()


def duplicates(broker: FakeBroker, store_rows: int) -> int:
    counts = collections.Counter(broker.row_messages())
    assert len(counts) == store_rows, "a committed row never arrived"
    return sum(n - 1 for n in counts.values())


both_depths = pytest.mark.parametrize("depth", [1, 2], ids=["serial", "pipelined"])


# -- the schedule --------------------------------------------------------------------
def test_step__serial_finishes_one_batch_in_order() -> None:
    journal: Journal = []
    store, broker = FakeStore(make_rows(15), journal), FakeBroker(journal)
    batches = make_batches(store, broker, depth=1)
    assert batches.step() == 10
    assert journal == [
        "claim 10",
        "prepare obx:outbox:r1:1",
        "send 10",
        "confirmed 10",
        "ledger 1",
        "commit obx:outbox:r1:1",
    ]
    assert batches.in_flight == {}


def test_step__pipelined_overlaps_two_batches_in_the_documented_order() -> None:
    journal: Journal = []
    store, broker = FakeStore(make_rows(25), journal), FakeBroker(journal)
    batches = make_batches(store, broker, depth=2)
    assert batches.step() == 10
    assert journal == ["claim 10", "prepare obx:outbox:r1:1", "send 10"]
    assert [b.state for b in batches.in_flight.values()] == [State.SENT]
    journal.clear()
    assert batches.step() == 10
    # N's confirms are in: N's evidence; claim+PREPARE N+1; publish N+1; commit N
    assert journal == [
        "confirmed 10",
        "ledger 1",
        "claim 10",
        "prepare obx:outbox:r1:2",
        "send 10",
        "commit obx:outbox:r1:1",
    ]
    journal.clear()
    broker.confirms_late = True
    assert batches.step() == 5
    # N's confirms not in yet: claim+PREPARE N+1 while N persists; publish N+1
    # beside it (the broker persists both); N's evidence; commit N
    assert journal == [
        "claim 5",
        "prepare obx:outbox:r1:3",
        "send 5",
        "confirmed 10",
        "ledger 1",
        "commit obx:outbox:r1:2",
    ]
    drain(batches)
    assert store.rows == {} and store.prepared == {}
    assert duplicates(broker, 25) == 0
    assert batches.stats.batches_committed == 3 and batches.stats.messages_published == 25


@both_depths
def test_step__nothing_claimable_claims_nothing(depth: int) -> None:
    store, broker = FakeStore([]), FakeBroker()
    batches = make_batches(store, broker, depth=depth)
    assert batches.step() == 0
    assert broker.delivered == [] and store.claim is None


@both_depths
def test_step__a_claim_cut_by_the_byte_budget_is_progress_until_drained(depth: int) -> None:
    # Each row is over the budget: one per batch.  The claim locks the rest of its
    # LIMIT until its batch is finished, so at depth 2 the next claim finds nothing;
    # the step that commits the batch must still count as progress, or the relay
    # waits for a wake-up (the poll interval) between every two batches.
    store, broker = FakeStore(make_rows(6)), FakeBroker()
    settings = Settings(batch_size=BATCH, pipeline=depth == 2, batch_max_bytes=1)
    batches = Batches(settings, broker, Stats(), may_commit=lambda: True)
    batches.store, batches.relay_id = store, "r1"
    steps = 0
    while batches.step():
        steps += 1
        assert steps < 20
    assert store.rows == {} and batches.in_flight == {}
    assert batches.stats.batches_committed == 6
    assert duplicates(broker, 6) == 0


# -- the crash table -----------------------------------------------------------------
CRASH_TABLE = [
    # point, nth occurrence, depth, duplicates after resolving and draining
    ("after_claim", 1, 1, 0),
    ("after_prepare", 1, 1, 0),
    # the fake broker takes every message sent at once; a real one, none to all of
    # them (crash table: "messages sent, not confirmed", duplicates ≤ batch)
    ("mid_publish", 1, 1, 10),
    ("after_publish", 1, 1, 10),
    ("after_ledger", 1, 1, 0),
    ("before_commit_prepared", 1, 1, 0),
    ("after_claim", 1, 2, 0),
    ("after_prepare", 1, 2, 0),
    ("mid_publish", 1, 2, 10),
    ("after_publish", 1, 2, 10),
    ("after_ledger", 1, 2, 10),  # batch 1 committed from evidence, batch 2 rolled back
    ("before_commit_prepared", 1, 2, 10),
    # batch 1 published; its confirms came before the claim of batch 2, so its
    # ledger record went out first: committed from that evidence
    ("after_claim", 2, 2, 0),
    ("after_prepare", 2, 2, 0),
    ("mid_publish", 2, 2, 10),  # batch 1 committed from its evidence, batch 2 out
]
# The same crashes when batch 1's confirms had not come by the claim of batch 2: its
# record is sent after that PREPARE, so the crash finds batch 1 without evidence.
CRASH_TABLE_LATE_CONFIRMS = [
    ("after_claim", 2, 2, 10),
    ("after_prepare", 2, 2, 10),
    # batch 2 went out before batch 1's confirms were in (published early): both
    # without evidence, both rolled back (≤ 2 batches, the pipelined bound)
    ("mid_publish", 2, 2, 20),
]


@pytest.mark.parametrize(
    ("point", "nth", "depth", "expected", "late"),
    [(*case, False) for case in CRASH_TABLE]
    + [(*case, True) for case in CRASH_TABLE_LATE_CONFIRMS],
)
def test_crash_table__resolved_and_drained_with_the_documented_duplicates(
    point: str, nth: int, depth: int, expected: int, late: bool
) -> None:
    store, broker = FakeStore(make_rows(30)), FakeBroker()
    broker.confirms_late = late
    dead = make_batches(store, broker, depth=depth, relay_id="dead")
    faults.arm(point, nth)
    with pytest.raises(Crashed):
        drain(dead)
    faults.disarm()

    store.claim = None  # the dead process's open transaction ends with its session
    assert len(store.prepared) <= depth, "a crash leaves at most `depth` batches prepared"
    for gid in list(store.prepared):  # a resolver pass, deciding from the ledger
        decision = decide(Owner.DEAD, gid in broker.ledger_gids())
        store.finish(gid, commit=decision.action is Action.COMMIT)

    drain(make_batches(store, broker, depth=depth, relay_id="next"))
    assert store.rows == {} and store.prepared == {}
    assert duplicates(broker, 30) == expected


class Recorder:
    """A port that journals every call made to the port it wraps (method and sizes)."""

    def __init__(self, port: object, calls: list[str]) -> None:
        self._port, self._calls = port, calls

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._port, name)
        if not callable(value):
            self._calls.append(name)
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            sizes = [len(a) for a in args if isinstance(a, list | tuple)]
            self._calls.append(f"{name}{sizes or ''}")
            return value(*args, **kwargs)

        return call


def _recorded_run(point: str | None, nth: int, depth: int, late: bool) -> list[str]:
    calls: list[str] = []
    store, broker = FakeStore(make_rows(30)), FakeBroker()
    broker.confirms_late = late
    batches = make_batches(store, broker, depth=depth)
    batches.broker = cast(BrokerPort, Recorder(broker, calls))
    batches.store = cast(BatchStorePort, Recorder(store, calls))
    if point is not None:
        faults.arm(point, nth)
    with contextlib.suppress(Crashed):
        drain(batches)
    faults.disarm()
    return calls


@pytest.mark.parametrize(
    ("point", "nth", "depth", "late"),
    [(p, n, d, False) for p, n, d, _ in CRASH_TABLE]
    + [(p, n, d, True) for p, n, d, _ in CRASH_TABLE_LATE_CONFIRMS],
)
def test_crash_points__an_armed_point_does_not_change_the_schedule(
    point: str, nth: int, depth: int, late: bool
) -> None:
    # Every call the batch makes to its ports, armed, is the call it makes unarmed:
    # the crash table is proven on the production schedule, cut at the point.
    production = _recorded_run(None, nth, depth, late)
    crashed = _recorded_run(point, nth, depth, late)
    assert 0 < len(crashed) < len(production)
    assert crashed == production[: len(crashed)]


# -- failure paths -------------------------------------------------------------------
@both_depths
def test_failure__prepare_cut_off_publishes_nothing_and_is_settled_by_lookup(depth: int) -> None:
    store, broker = FakeStore(make_rows(5)), FakeBroker()
    batches = make_batches(store, broker, depth=depth)
    store.fail_next["prepare"] = OutcomeUnknown("connection lost during PREPARE")
    with pytest.raises(OutcomeUnknown):
        batches.step()
    assert broker.delivered == []
    [batch] = batches.in_flight.values()
    assert batch.state is State.IN_DOUBT
    store.claim = None  # the session died with the PREPARE: the server never ran it
    batches.settle()
    assert batches.in_flight == {} and batches.stats.batches_rolled_back == 1
    drain(batches)
    assert duplicates(broker, 5) == 0


@both_depths
def test_failure__nack_rolls_back_counts_duplicates_and_retries(depth: int) -> None:
    nacked: set[str] = set()

    def nack_once(message: object) -> bool:
        key = getattr(message, "message_id", "")
        if key.startswith("ledger") or nacked:
            return False
        nacked.add(key)
        return True

    store = FakeStore(make_rows(10))
    broker = FakeBroker(routing=Routing(nack=nack_once))
    batches = make_batches(store, broker, depth=depth)
    with pytest.raises(BrokerUnavailable, match="not confirmed"):
        for _ in range(depth):
            batches.step()
    assert store.prepared == {} and batches.in_flight == {}
    assert batches.stats.batches_rolled_back == 1
    assert batches.stats.duplicates_possible == 9  # the others were accepted
    drain(batches)
    assert duplicates(broker, 10) == 9


@both_depths
def test_failure__ledger_not_confirmed_rolls_back_and_probes_before_the_next(depth: int) -> None:
    failing = {"on": True}
    store = FakeStore(make_rows(10))
    broker = FakeBroker(
        routing=Routing(nack=lambda m: failing["on"] and m.message_id.startswith("ledger"))
    )
    batches = make_batches(store, broker, depth=depth)
    with pytest.raises(BrokerUnavailable, match="ledger"):
        for _ in range(depth):
            batches.step()
    assert batches.ledger_doubtful and store.prepared == {}
    with pytest.raises(BrokerUnavailable, match="takes no records"):
        batches.step()  # the probe fails: nothing is claimed or published
    assert len(broker.row_messages()) == 10
    failing["on"] = False
    drain(batches)
    assert duplicates(broker, 10) == 10


@both_depths
def test_failure__stale_heartbeat_rolls_back_instead_of_writing_evidence(depth: int) -> None:
    store, broker = FakeStore(make_rows(10)), FakeBroker()
    batches = make_batches(store, broker, depth=depth, may_commit=False)
    with pytest.raises(DatabaseUnavailable, match="heartbeat is stale"):
        for _ in range(depth):
            batches.step()
    assert broker.ledger_gids() == set() and store.prepared == {}


@pytest.mark.parametrize("late", [False, True], ids=["recorded", "confirms_late"])
def test_failure__published_batch_outlives_a_database_failure_of_the_next_prepare(
    late: bool,
) -> None:
    """Pipelined: N is published, N+1's PREPARE finds no slot.  N stays in flight
    (its ledger record sent before the claim, or not yet if its confirms were late),
    is finished on the next step, and costs no duplicate."""
    store, broker = FakeStore(make_rows(20)), FakeBroker()
    broker.confirms_late = late
    batches = make_batches(store, broker, depth=2)
    batches.step()
    store.fail_next["prepare"] = PreparedSlotsExhausted("every slot is in use")
    with pytest.raises(PreparedSlotsExhausted):
        batches.step()
    [kept] = batches.in_flight.values()
    assert kept.state is (State.SENT if late else State.RECORDED)
    assert kept.kept
    store.claim = None  # the failed PREPARE rolled its claim back
    drain(batches)
    assert duplicates(broker, 20) == 0


def test_stop__without_a_database_session_leaves_batches_in_doubt_to_resolvers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Stopping while the database is down (the store lost, not reopened): no
    AssertionError, the batch is left prepared for a resolver, and the log says so."""
    store, broker = FakeStore(make_rows(20)), FakeBroker()
    batches = make_batches(store, broker, depth=2)
    batches.step()
    batches.store = None
    batches.finish_in_flight()
    assert [b.state for b in batches.in_flight.values()] == [State.IN_DOUBT]
    assert len(store.prepared) == 1
    assert "relay.stopped_with_batches_in_doubt" in caplog.text


def test_failure__broker_loss_puts_the_published_batch_in_doubt() -> None:
    store, broker = FakeStore(make_rows(20)), FakeBroker()
    batches = make_batches(store, broker, depth=2)
    batches.step()
    broker.lose_connection_on_confirm = True
    with pytest.raises(BrokerUnavailable, match="lost RabbitMQ"):
        batches.step()
    # batch 1 (no confirm) was rolled back at once; batch 2, published beside it
    # while its confirms were due, is in doubt
    assert all(b.state is State.IN_DOUBT for b in batches.in_flight.values())
    batches.settle()
    assert store.prepared == {}
    broker.connected = True
    drain(batches)
    assert duplicates(broker, 20) == 20  # both batches: the pipelined bound


def test_schedule__the_next_batch_goes_out_beside_one_whose_confirms_are_due() -> None:
    """Pipelined, N's confirms not in at N+1's PREPARE: N+1 is published at once,
    so the broker persists both (it would otherwise sit idle between N's last
    confirm and N+1's send); still at most two batches prepared, none lost."""
    journal: Journal = []
    store, broker = FakeStore(make_rows(40), journal), FakeBroker(journal)
    broker.confirms_late = True
    batches = make_batches(store, broker, depth=2)
    batches.step()
    journal.clear()
    batches.step()
    assert journal.index("send 10") < journal.index("confirmed 10")
    assert len(store.prepared) <= 2
    drain(batches)
    assert store.rows == {} and store.prepared == {}
    assert duplicates(broker, 40) == 0


def test_schedule__a_nack_of_one_batch_keeps_the_one_published_beside_it() -> None:
    """N is nacked on a live connection after N+1 went out early: N is rolled back,
    N+1 is kept and committed from its own confirms: no duplicate of N+1."""
    nacked: set[str] = set()

    def nack_once(message: object) -> bool:
        key = getattr(message, "message_id", "")
        if key.startswith("ledger") or nacked or getattr(message, "body", b"") != b"row 3":
            return False
        nacked.add(key)
        return True

    store = FakeStore(make_rows(20))
    broker = FakeBroker(routing=Routing(nack=nack_once))
    broker.confirms_late = True
    batches = make_batches(store, broker, depth=2)
    batches.step()
    with pytest.raises(BrokerUnavailable, match="not confirmed"):
        batches.step()
    [second] = batches.in_flight.values()
    assert (second.state, second.kept) == (State.SENT, True)
    assert batches.step() == 10  # finishes the kept batch first; publishes nothing early
    drain(batches)
    assert store.rows == {} and store.prepared == {}
    assert batches.stats.batches_rolled_back == 1
    assert duplicates(broker, 20) == 9  # batch 1's accepted messages only


def test_schedule__nothing_goes_out_early_after_a_failure_until_a_commit() -> None:
    journal: Journal = []
    store, broker = FakeStore(make_rows(40), journal), FakeBroker(journal)
    broker.confirms_late = True
    batches = make_batches(store, broker, depth=2)
    batches.step()
    batches.fail(DatabaseUnavailable("lost"))  # the published batch survives, kept
    journal.clear()
    batches.step()
    # the kept batch is finished first; the next is then claimed, nothing is waiting
    assert journal[:3] == ["confirmed 10", "ledger 1", "commit obx:outbox:r1:1"]
    journal.clear()
    batches.step()
    # a commit came since the failure: early again
    assert journal.index("send 10") < journal.index("confirmed 10")
    drain(batches)
    assert duplicates(broker, 40) == 0


def test_schedule__two_published_batches_outlive_a_database_failure() -> None:
    """N's COMMIT PREPARED is cut off while N+1, published early, waits: N is in
    doubt (looked up: committed), N+1 is kept and finished: no duplicate."""
    store, broker = FakeStore(make_rows(30)), FakeBroker()
    broker.confirms_late = True
    batches = make_batches(store, broker, depth=2)
    batches.step()
    store.fail_next["finish"] = OutcomeUnknown("connection lost during COMMIT PREPARED")
    with pytest.raises(OutboxError):
        batches.step()
    states = sorted(b.state.name for b in batches.in_flight.values())
    assert states == ["IN_DOUBT", "SENT"]
    batches.settle()
    drain(batches)
    assert store.rows == {} and store.prepared == {}
    assert duplicates(broker, 30) == 0


def test_failure__broker_loss_after_the_next_batch_went_out_puts_both_in_doubt() -> None:
    """Pipelined: N's ledger confirm is lost after N+1 was published.  The broker
    failure puts N+1's confirms in doubt too: it is not kept, it is rolled back."""
    store, broker = FakeStore(make_rows(30)), FakeBroker()
    batches = make_batches(store, broker, depth=2)
    batches.step()
    broker.lose_connection_on_ledger_confirm = True
    with pytest.raises(BrokerUnavailable, match="could not record"):
        batches.step()
    [second] = batches.in_flight.values()  # N was rolled back at once
    assert (second.state, second.kept) == (State.IN_DOUBT, False)
    batches.settle()
    # N's 10 accepted messages, and N+1's 10 sent ones rolled back while settling
    assert batches.stats.duplicates_possible == 20
    broker.connected = True
    drain(batches)
    assert store.prepared == {}
    assert duplicates(broker, 30) == 20


@both_depths
def test_failure__commit_prepared_cut_off_is_committed_after_lookup(depth: int) -> None:
    store, broker = FakeStore(make_rows(10)), FakeBroker()
    batches = make_batches(store, broker, depth=depth)
    store.fail_next["finish"] = OutcomeUnknown("connection lost during COMMIT PREPARED")
    with pytest.raises(OutcomeUnknown):
        drain(batches)
    [batch] = batches.in_flight.values()
    assert (batch.state, batch.evidence) == (State.IN_DOUBT, True)
    batches.settle()
    assert store.rows == {} and batches.stats.batches_committed == 1
    assert duplicates(broker, 10) == 0


@both_depths
def test_failure__unwritable_dead_letters_roll_back_once_then_publish_nothing(
    depth: int,
) -> None:
    rows = make_rows(4) + make_rows(1, start=5, key="nowhere")
    store = FakeStore(rows)
    broker = FakeBroker(routing=Routing(unroutable_keys={"nowhere"}))
    batches = make_batches(store, broker, depth=depth)
    store.fail_next["record_dead_letters"] = DeadLettersUnwritable("INSERT refused")
    with pytest.raises(DeadLettersUnwritable):
        for _ in range(depth):
            batches.step()
    assert store.prepared == {} and len(broker.row_messages()) == 4
    drain(batches)  # the dead letter is known now: recorded before anything is sent
    assert [d.row.id for d in store.dead_letters] == [5]
    assert duplicates(broker, 4) == 4


@both_depths
@pytest.mark.parametrize(
    "error",
    [DeadLettersUnwritable, StatementTimedOut, DatabaseRefused],
    ids=["unwritable", "timed-out", "refused"],
)
def test_failure__dead_letter_write_failing_any_way_publishes_the_batch_once_in_all(
    depth: int, error: type[OutboxError]
) -> None:
    """Issue 19: only a refused INSERT was remembered; a timeout or an index error
    published the batch's good rows again on every retry."""
    rows = make_rows(4) + make_rows(1, start=5, key="nowhere")
    store = FakeStore(rows)
    broker = FakeBroker(routing=Routing(unroutable_keys={"nowhere"}))
    batches = make_batches(store, broker, depth=depth)
    for _ in range(20):  # the write keeps failing, whatever the relay tries
        store.fail_next["record_dead_letters"] = error("the dead-letter INSERT failed")
        with pytest.raises(error) as raised:
            for _ in range(depth):
                batches.step()
        assert raised.value.write == "dead_letters"
        batches.settle()
        assert store.prepared == {}
    assert len(broker.row_messages()) == 4, "published again while the write failed"
    assert batches.stats.write_failures == {"dead_letters": 20}
    drain(batches)
    assert [d.row.id for d in store.dead_letters] == [5]
    assert duplicates(broker, 4) == 4


class RefusingStore(FakeStore):
    """Refuses the dead letter of one row (a constraint it violates), takes the others."""

    def __init__(self, rows: list[OutboxRow], refused: int) -> None:
        super().__init__(rows)
        self.refused: int | None = refused

    def record_dead_letters(self, dead: Sequence[DeadLetter], gid: str) -> None:
        if any(d.row.id == self.refused for d in dead):
            raise DeadLettersUnwritable(f"row {self.refused} violates a check constraint")
        super().record_dead_letters(dead, gid)


@both_depths
def test_failure__dead_letter_refused_for_one_row_holds_its_batch_unpublished(
    depth: int,
) -> None:
    """A dead letter the table refuses for one row (a constraint someone added) holds
    the claim at that row, published once, until it can be written: the rows stay
    in the outbox, none is lost and none goes out again while it is refused."""
    rows = make_rows(4) + make_rows(1, start=5, key="nowhere") + make_rows(5, start=6)
    rows += make_rows(1, start=11, key="nowhere") + make_rows(4, start=12)
    store = RefusingStore(rows, refused=5)
    broker = FakeBroker(routing=Routing(unroutable_keys={"nowhere"}))
    batches = make_batches(store, broker, depth=depth)
    batches.settings = dataclasses.replace(batches.settings, batch_size=5)
    for _ in range(30):
        with contextlib.suppress(DeadLettersUnwritable, OutcomeUnknown):
            batches.step()
        batches.settle()
    counts = collections.Counter(broker.row_messages())
    assert max(counts.values()) <= 2, counts
    assert batches.stats.write_failures["dead_letters"] >= 20
    store.refused = None
    drain(batches)
    assert {d.row.id for d in store.dead_letters} == {5, 11}
    assert max(collections.Counter(broker.row_messages()).values()) <= 2


# -- dead letters and budgets ------------------------------------------------------
@both_depths
def test_dead_letters__unroutable_and_missing_exchange_never_block_good_rows(depth: int) -> None:
    rows = (
        make_rows(3) + make_rows(1, start=4, key="nowhere") + make_rows(1, start=5, exchange="gone")
    )
    rows += make_rows(3, start=6)
    store = FakeStore(rows)
    broker = FakeBroker(routing=Routing(unroutable_keys={"nowhere"}))
    batches = make_batches(store, broker, depth=depth)
    drain(batches)
    assert store.rows == {} and store.prepared == {}
    reasons = {d.row.id: d.reason for d in store.dead_letters}
    assert set(reasons) == {4, 5}
    assert "unroutable" in reasons[4] and "does not exist" in reasons[5]
    assert duplicates(broker, 6) == 0


def test_claim__byte_budget_is_passed_to_the_store() -> None:
    store, broker = FakeStore(make_rows(10)), FakeBroker()
    batches = make_batches(store, broker, depth=1)
    batches.settings = dataclasses.replace(batches.settings, batch_max_bytes=12)
    # "row 1", "row 2", … are 5 bytes each: the rows starting at 0, 5 and 10 bytes fit
    assert batches.step() == 3


# -- per-key ordering ------------------------------------------------------------------
def key_order(broker: FakeBroker, rows: list[OutboxRow]) -> dict[str, list[int]]:
    """Each key's row ids as first delivered (repeats dropped, as a consumer would)."""
    by_message = {str(r.message_id): r for r in rows}
    seen: set[str] = set()
    order: dict[str, list[int]] = collections.defaultdict(list)
    for message in broker.delivered:
        row = by_message.get(message.message_id)
        if row is None or message.message_id in seen:
            continue
        seen.add(message.message_id)
        assert (message.headers or {}).get("x-ordering-key") == row.ordering_key
        if row.ordering_key is not None:
            order[row.ordering_key].append(row.id)
    return dict(order)


@both_depths
def test_ordering__a_keys_rows_go_in_waves_each_after_the_one_before_is_confirmed(
    depth: int,
) -> None:
    journal: Journal = []
    rows = make_rows(6, ordering_keys=["a", "a", "b", None, "a", "b"])
    store, broker = FakeStore(rows, journal), FakeBroker(journal)
    batches = make_batches(store, broker, depth=depth)
    drain(batches)
    sends = [entry for entry in journal if entry.startswith(("send", "confirmed"))]
    # wave 0: rows 1 (a), 3 (b), 4; wave 1: 2 (a), 6 (b); wave 2: 5 (a)
    assert sends == ["send 3", "confirmed 3", "send 2", "confirmed 2", "send 1", "confirmed 1"]
    assert key_order(broker, rows) == {"a": [1, 2, 5], "b": [3, 6]}
    assert store.rows == {} and duplicates(broker, 6) == 0


@both_depths
@pytest.mark.parametrize("mode", ["block", "skip"])
def test_ordering__a_returned_row_holds_its_keys_later_rows_back_or_not(
    depth: int, mode: str
) -> None:
    rows = make_rows(1, ordering_keys=["a"]) + make_rows(1, start=2, key="nowhere")
    rows += make_rows(3, start=3, ordering_keys=["b", "b", "a"])
    rows[1] = rows[1]._replace(ordering_key="b")  # row 2: b, unroutable
    store = FakeStore(rows)
    broker = FakeBroker(routing=Routing(unroutable_keys={"nowhere"}))
    batches = make_batches(store, broker, depth=depth)
    batches.settings = dataclasses.replace(batches.settings, ordering_dead_letters=mode)
    drain(batches)
    reasons = {d.row.id: d.reason for d in store.dead_letters}
    if mode == "block":
        assert key_order(broker, rows) == {"a": [1, 5]}
        assert set(reasons) == {2, 3, 4}
        assert "unroutable" in reasons[2] and "(row 2)" in reasons[3] and "(row 2)" in reasons[4]
    else:
        assert key_order(broker, rows) == {"a": [1, 5], "b": [3, 4]}
        assert set(reasons) == {2}
    assert store.rows == {} and store.prepared == {}


@both_depths
def test_ordering__a_nack_stops_the_batch_before_the_keys_next_row(depth: int) -> None:
    rows = make_rows(4, ordering_keys=["a", "a", "a", None])
    nacked: list[str] = []

    def nack_first_of_a(message: object) -> bool:
        if not nacked and getattr(message, "message_id", "") == str(rows[0].message_id):
            nacked.append("once")
            return True
        return False

    store = FakeStore(rows)
    broker = FakeBroker(routing=Routing(nack=nack_first_of_a))
    batches = make_batches(store, broker, depth=depth)
    with pytest.raises(BrokerUnavailable):
        batches.step()
        batches.step()
    # Row 1 was refused: rows 2 and 3 never went out behind it.
    assert [m.message_id for m in broker.delivered] == [str(rows[3].message_id)]
    drain(batches)
    assert key_order(broker, rows) == {"a": [1, 2, 3]}


@both_depths
def test_ordering__a_key_with_an_older_dead_letter_is_held_at_claim(depth: int) -> None:
    [old] = make_rows(1, ordering_keys=["a"])
    rows = make_rows(3, start=2, ordering_keys=["a", None, "a"])
    store, broker = FakeStore(rows), FakeBroker()
    store.dead_letters.append(DeadLetter(old, "bad earlier"))
    batches = make_batches(store, broker, depth=depth)
    drain(batches)
    assert key_order(broker, rows) == {}
    held = {d.row.id: d.reason for d in store.dead_letters if d.row.id != 1}
    assert set(held) == {2, 4} and all("(row 1)" in r for r in held.values())
    assert store.rows == {}


def test_ordering__a_batch_behind_its_own_batch_in_flight_goes_out_after_its_commit() -> None:
    journal: Journal = []
    rows = make_rows(20, ordering_keys=["a", "b"])  # batches of 10: 5 waves of a and b each
    store, broker = FakeStore(rows, journal), FakeBroker(journal)
    batches = make_batches(store, broker, depth=2)
    drain(batches)
    # Batch 2 holds the next rows of a and b: claimed and prepared while batch 1 waits
    # for the broker, published only after batch 1 is committed.
    second_prepare = journal.index("prepare obx:outbox:r1:2")
    first_commit = journal.index("commit obx:outbox:r1:1")
    second_send = next(
        i for i, entry in enumerate(journal) if i > second_prepare and entry.startswith("send")
    )
    assert second_prepare < first_commit < second_send
    assert key_order(broker, rows) == {"a": list(range(1, 21, 2)), "b": list(range(2, 21, 2))}


def test_ordering__a_following_batch_is_rolled_back_unpublished_when_the_first_fails() -> None:
    rows = make_rows(20, ordering_keys=["a", "b"])
    store, broker = FakeStore(rows), FakeBroker()
    broker.lose_connection_on_ledger_confirm = True  # batch 1 loses its evidence
    batches = make_batches(store, broker, depth=2)
    with pytest.raises(BrokerUnavailable):
        batches.step()
        batches.step()
    # Batch 1 was rolled back; batch 2, never published, is in doubt until settled.
    assert len(broker.row_messages()) == 10
    assert [b.state for b in batches.in_flight.values()] == [State.IN_DOUBT]
    broker.connected = True
    batches.settle()
    assert store.prepared == {} and len(broker.row_messages()) == 10
    drain(batches)
    assert key_order(broker, rows) == {"a": list(range(1, 21, 2)), "b": list(range(2, 21, 2))}


def test_ordering__a_following_batch_holds_rows_behind_the_first_ones_dead_letters() -> None:
    rows = make_rows(20, ordering_keys=["a", "b"])
    rows[2] = rows[2]._replace(routing_key="nowhere")  # row 3, key a
    store = FakeStore(rows)
    broker = FakeBroker(routing=Routing(unroutable_keys={"nowhere"}))
    batches = make_batches(store, broker, depth=2)
    drain(batches)
    assert key_order(broker, rows) == {"a": [1], "b": list(range(2, 21, 2))}
    assert sorted(d.row.id for d in store.dead_letters) == list(range(3, 21, 2))


@pytest.mark.parametrize("late", [False, True], ids=["recorded", "confirms_late"])
def test_failure__a_resource_alarm_before_the_next_claim_keeps_the_published_batch(
    late: bool,
) -> None:
    """Pipelined: N is published (its ledger record sent early, or not yet), then the
    broker blocks publishers.  The connection lives and still confirms what it read:
    N is kept, finished first once the alarm clears, and costs no duplicate."""
    store, broker = FakeStore(make_rows(20)), FakeBroker()
    broker.confirms_late = late
    batches = make_batches(store, broker, depth=2)
    batches.step()
    broker.blocked = True
    with pytest.raises(BrokerBlocked):
        batches.step()
    [kept] = batches.in_flight.values()
    assert kept.state is (State.SENT if late else State.RECORDED)
    assert kept.kept
    broker.blocked = False
    drain(batches)
    assert duplicates(broker, 20) == 0
    assert batches.stats.batches_rolled_back == 0


def test_failure__a_resource_alarm_outlasting_the_ledger_confirm_rolls_the_kept_batch_back() -> (
    None
):
    """The alarm outlasts ``publish_timeout``: the kept batch's ledger confirm never
    comes, and it is rolled back then (its messages sent again: one batch)."""
    store, broker = FakeStore(make_rows(20)), FakeBroker()
    batches = make_batches(store, broker, depth=2)
    batches.step()
    broker.blocked = True
    with pytest.raises(BrokerBlocked):
        batches.step()
    broker.lose_connection_on_ledger_confirm = True  # pika's blocked_timeout closed it
    with pytest.raises(BrokerUnavailable):
        batches.step()
    assert batches.stats.batches_rolled_back == 1
    broker.blocked, broker.connected = False, True
    batches.settle()
    drain(batches)
    assert duplicates(broker, 20) == 10
