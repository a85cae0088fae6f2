"""The consumer loop on in-memory fakes (``fakes.py``): the order of each
message's steps, the handler contract checked after every call, failures that
count only their own message, outages, and the promise as a property."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox.amqp.message import InboxMessage
from outbox.db.inbox import SETTINGS, SessionState, StatementRefused
from outbox.errors import DatabaseUnavailable
from outbox.inbox.planning import Disposition
from outbox.inbox.process import Inbox
from outbox.inbox.settings import ConsumerSettings
from outbox.inbox.stats import ConsumerStats
from outbox.inbox.steps import (
    AHEAD_PAUSE,
    Broken,
    Processor,
    handler_left,
    needs_sync_mode,
    record_ahead,
)
from tests.unit.inbox.fakes import FakeBroker, FakeConnection, FakeStore, message

SETTINGS_FOR_TESTS = ConsumerSettings(queue="q", max_attempts=2, retry_delay=0.0)


class Fatal(BaseException):
    pass


def act(conn: FakeConnection, msg: InboxMessage) -> None:
    """Do what the body says (the unit twin of support.HANDLERS' ``act``)."""
    what = msg.body.decode()
    if what == "ok":
        conn.apply(str(msg.message_id))
    elif what == "raise":
        raise RuntimeError("refused")
    elif what == "exit":
        raise SystemExit(3)
    elif what == "interrupt":
        raise KeyboardInterrupt
    elif what == "fatal":
        raise Fatal
    elif what == "commit":
        conn.apply(str(msg.message_id))
        conn.commit()
    elif what == "commit_swallowed":
        conn.apply(str(msg.message_id))
        try:
            conn.commit()
        except Exception:
            conn.apply(str(msg.message_id))  # and goes on in a new transaction
    elif what == "rollback":
        conn.apply(str(msg.message_id))
        conn.rollback()
    elif what == "rollback_more":
        conn.apply(str(msg.message_id))
        conn.rollback()
        conn.apply(str(msg.message_id))
    elif what == "close":
        conn.apply(str(msg.message_id))
        conn.close()
    elif what == "lose":
        conn.apply(str(msg.message_id))
        conn.lose_session()
        raise RuntimeError("server closed the connection unexpectedly")
    elif what == "lose_quietly":  # the server ends the session after the handler's last statement
        conn.apply(str(msg.message_id))
        conn.lose_session()
    elif what == "swallow":
        conn.apply(str(msg.message_id))
        with contextlib.suppress(Exception):
            conn.fail_statement()
    elif what == "row_factory":
        conn.row_factory = "dict_row"
        conn.apply(str(msg.message_id))
    elif what == "prepare_threshold":
        conn.prepare_threshold = None
        conn.apply(str(msg.message_id))
    else:
        raise AssertionError(what)


FAILING = [
    "raise",
    "exit",
    "interrupt",
    "fatal",
    "commit",
    "commit_swallowed",
    "rollback",
    "rollback_more",
    "close",
    "lose",
    "lose_quietly",
    "swallow",
    "row_factory",
    "prepare_threshold",
]


def processor(store: FakeStore, **kwargs: Any) -> Processor:
    return Processor(store, act, SETTINGS_FOR_TESTS, ConsumerStats(), **kwargs)


def batch(*bodies: str) -> list[InboxMessage]:
    return [message(f"m{i}", body.encode()) for i, body in enumerate(bodies)]


# -- the order of the steps -----------------------------------------------------------
def test_loop__a_batch_records_ids_calls_handlers_seals_and_commits_once() -> None:
    store = FakeStore()
    outcomes = processor(store).process_batch(batch("ok", "ok", "ok"))
    assert outcomes == [(Disposition.HANDLED, 0.0)] * 3
    assert store.journal == ["record_ids ['m0', 'm1', 'm2']", "seal", "commit"]
    assert store.effects == ["m0", "m1", "m2"] and store.inbox == {"m0", "m1", "m2"}


def test_loop__copies_are_skipped_in_the_batch_and_after_it() -> None:
    store = FakeStore()
    p = processor(store)
    first = [message("a", b"ok"), message("a", b"ok"), message("b", b"ok")]
    assert [o for o, _ in p.process_batch(first)] == [
        Disposition.HANDLED,
        Disposition.DUPLICATE,
        Disposition.HANDLED,
    ]
    assert [o for o, _ in p.process_batch([message("a", b"ok"), message("b", b"ok")])] == [
        Disposition.DUPLICATE,
        Disposition.DUPLICATE,
    ]
    assert store.effects == ["a", "b"]
    assert p.stats.handled == 2 and p.stats.duplicates_skipped == 3


def test_ahead__a_batch_that_meets_an_id_applied_before_runs_again_ids_first() -> None:
    """Recorded ahead, all ids taken for new: the copy's handler ran, but the
    transaction is rolled back when the ids' result shows it, and the batch runs
    again with its ids recorded first, so the copy's effect never commits."""
    store = FakeStore()
    calls: list[str] = []

    def counting(conn: FakeConnection, msg: InboxMessage) -> None:
        calls.append(str(msg.message_id))
        act(conn, msg)

    p = Processor(store, counting, SETTINGS_FOR_TESTS, ConsumerStats())
    p.process_batch([message("a", b"ok"), message("b", b"ok")])
    assert store.journal.count("commit") == 1 and p.ahead_paused == 0
    outcomes = p.process_batch([message("a", b"ok"), message("c", b"ok")])
    assert [o for o, _ in outcomes] == [Disposition.DUPLICATE, Disposition.HANDLED]
    assert store.effects == ["a", "b", "c"] and store.inbox == {"a", "b", "c"}
    assert calls == ["a", "b", "a", "c", "c"]  # the copy ran once, rolled back
    assert store.journal[-4:] == ["restore", "record_ids ['a', 'c']", "seal", "commit"]
    assert p.pipelining and p.stats.duplicates_skipped == 1 and store.attempts == {}
    # The next batches record their ids first, then ahead again.
    assert p.ahead_paused == AHEAD_PAUSE
    for i in range(AHEAD_PAUSE):
        p.process_batch([message(f"x{i}", b"ok"), message(f"y{i}", b"ok")])
    assert p.ahead_paused == 0


@pytest.mark.parametrize(
    ("messages", "pipelined", "paused", "ahead"),
    [
        (2, True, 0, True),
        (1, True, 0, False),  # one alone gains nothing
        (2, False, 0, False),  # without pipelining there is nothing to send it with
        (2, True, 3, False),  # a batch ran again lately
    ],
)
def test_record_ahead__only_pipelined_batches_of_first_deliveries(
    messages: int, pipelined: bool, paused: int, ahead: bool
) -> None:
    first = [message(f"m{i}") for i in range(messages)]
    assert record_ahead(first, pipelined=pipelined, paused=paused) is ahead
    again = [*first, message("r", redelivered=True)]
    assert record_ahead(again, pipelined=pipelined, paused=paused) is False


def test_loop__messages_without_id_or_readable_properties_are_parked_unseen() -> None:
    store = FakeStore()
    unreadable = message("u", b"ok", properties={"x-outbox-unreadable-properties": "bad"})
    outcomes = processor(store).process_batch([message(None, b"ok"), unreadable, *batch("ok")])
    assert [o for o, _ in outcomes] == [Disposition.PARKED, Disposition.PARKED, Disposition.HANDLED]
    assert [p.error for p in store.parked] == [
        "no message_id: cannot be deduplicated",
        "its AMQP properties cannot be read: bad",
    ]
    assert store.effects == ["m0"]


# -- the handler contract -------------------------------------------------------------------
@pytest.mark.parametrize("behaviour", FAILING)
@pytest.mark.parametrize("size", [1, 4])
def test_contract__a_broken_handler_fails_only_its_message(behaviour: str, size: int) -> None:
    """Alone or in a batch (rolled back, then one by one): the others are applied
    once, only the culprit counts an attempt, the session is usable again with
    its settings, and no id is committed without its effect."""
    store = FakeStore()
    p = processor(store)
    messages = [message("bad", behaviour.encode()), *batch(*["ok"] * (size - 1))]
    outcomes = p.process_batch(messages)
    assert outcomes[0] == (Disposition.RETRY, 0.0)
    assert all(o == Disposition.HANDLED for o, _ in outcomes[1:])
    assert store.attempts == {"bad": 1}
    assert sorted(store.effects) == sorted(m.message_id for m in messages[1:])
    assert store.inbox == set(store.effects)
    assert not store.broken and store.session() == FakeStore().session()
    # The second attempt parks it; a later copy is skipped.
    assert p.process(dataclasses.replace(messages[0], redelivered=True))[0] is Disposition.PARKED
    assert p.process(messages[0])[0] is Disposition.DUPLICATE
    assert [x.message_id for x in store.parked] == ["bad"] and "bad" not in store.effects
    assert p.stats.handler_failures == 2


def test_contract__keyboard_interrupt_asks_to_stop_only_without_signal_handlers() -> None:
    stops: list[bool] = []
    p = processor(FakeStore(), on_interrupt=lambda: stops.append(True))
    assert p.process(message("i", b"interrupt"))[0] is Disposition.RETRY
    assert stops == [True]


def test_contract__a_refused_commit_is_the_failure_of_the_message_alone() -> None:
    store = FakeStore()
    store.fail_next["commit"] = StatementRefused("deferred constraint")
    p = processor(store)
    assert p.process(message("d", b"ok"))[0] is Disposition.RETRY
    assert store.attempts == {"d": 1} and store.effects == []


def test_contract__a_deadlock_between_batches_splits_the_batch_and_blames_nobody() -> None:
    store = FakeStore()
    store.fail_next["record_ids"] = StatementRefused("deadlock detected")
    outcomes = processor(store).process_batch(batch("ok", "ok"))
    assert [o for o, _ in outcomes] == [Disposition.HANDLED, Disposition.HANDLED]
    assert store.attempts == {}


# -- outages ------------------------------------------------------------------------------
def test_outage__a_session_that_cannot_be_replaced_is_an_outage_and_the_attempt_is_owed() -> None:
    store = FakeStore()
    p = processor(store)
    store.fail_next["reconnect"] = DatabaseUnavailable("server down")
    with pytest.raises(DatabaseUnavailable):
        p.process(message("l", b"lose"))
    assert store.attempts == {} and [m.message_id for m, *_ in p.owed] == ["l"]
    store.reconnect()  # the database is back
    assert p.process(message("g", b"ok"))[0] is Disposition.HANDLED
    assert store.attempts == {"l": 1} and p.owed == []


def test_outage__lost_before_any_handler_ran_owes_nothing() -> None:
    store = FakeStore()
    store.fail_next["record_ids"] = DatabaseUnavailable("gone")
    p = processor(store)
    with pytest.raises(DatabaseUnavailable):
        p.process(message("a", b"ok"))
    assert p.owed == [] and store.attempts == {}


def test_outage__a_batch_recorded_ahead_on_a_lost_session_owes_the_attempt_in_hand() -> None:
    """The ids go out in the pipeline with the handlers' statements, so a session
    lost there is found in a handler's time: the message in hand owes its attempt,
    as when the session is lost in a handler of a batch whose ids went first."""
    store = FakeStore()
    store.fail_next["record_ids"] = DatabaseUnavailable("gone")
    store.down = True
    p = processor(store)
    with pytest.raises(DatabaseUnavailable):
        p.process_batch(batch("ok", "ok"))
    assert [m.message_id for m, _, _ in p.owed] == ["m0"]
    assert store.attempts == {} and store.effects == []


def test_outage__a_batch_recorded_ahead_on_a_lost_session_runs_again_on_a_new_one() -> None:
    store = FakeStore()
    store.fail_next["record_ids"] = DatabaseUnavailable("gone")
    p = processor(store)
    outcomes = p.process_batch(batch("ok", "ok"))
    assert [o for o, _ in outcomes] == [Disposition.HANDLED, Disposition.HANDLED]
    assert p.owed == [] and store.attempts == {} and len(store.effects) == 2
    assert "reconnect" in store.journal and p.pipelining


def test_outage__lost_during_commit_is_unknown_and_owes_nothing() -> None:
    store = FakeStore()
    store.fail_next["commit"] = DatabaseUnavailable("lost during COMMIT")
    p = processor(store)
    with pytest.raises(DatabaseUnavailable):
        p.process(message("c", b"ok"))
    assert p.owed == [] and store.attempts == {}


# -- the handler's session, judged (pure) ----------------------------------------------------
def state(**changes: Any) -> SessionState:
    base = SessionState(False, False, "intrans", tuple(SETTINGS))
    return base._replace(**changes)


@pytest.mark.parametrize(
    ("after", "words"),
    [
        (state(closed=True), "closed the connection"),
        (state(broken=True), "session ended"),
        (state(transaction="inerror"), "caught a database error"),
        (state(transaction="idle"), "ended the transaction"),
        (state(transaction="unknown"), "ended the transaction"),
        (
            state(settings=tuple("changed" if n == "row_factory" else n for n in SETTINGS)),
            "changed the connection's settings (row_factory)",
        ),
    ],
)
def test_handler_left__names_what_breaks_the_contract(after: SessionState, words: str) -> None:
    reason = handler_left(state(), after)
    assert reason is not None and words in reason


def test_handler_left__nothing_when_the_transaction_is_as_it_was() -> None:
    assert handler_left(state(), state()) is None


def test_handler_left__an_unsynced_begin_shows_idle_until_the_sync() -> None:
    """Ids recorded ahead: the BEGIN went out in the pipeline, and once a handler's
    read brought the results in flight, libpq shows the session idle (no sync has
    said otherwise); that is checked again after the sync, not failed now."""
    idle = state(transaction="idle")
    assert handler_left(state(), idle, pending=True, unsynced=True) is None
    assert "ended the transaction" in str(handler_left(state(), idle, pending=True))
    assert "ended the transaction" in str(handler_left(state(), idle, unsynced=True))
    aborted = state(transaction="inerror")
    assert "caught a database error" in str(
        handler_left(state(), aborted, pending=True, unsynced=True)
    )


@pytest.mark.parametrize(
    ("blamed", "lost", "needs"),
    [
        (Disposition.HANDLED, False, True),  # failed pipelined, succeeded on its own
        (Disposition.DUPLICATE, False, False),  # another consumer applied a copy meanwhile
        (Disposition.RETRY, False, False),  # a real failure
        (Disposition.HANDLED, True, False),  # the session was lost: no handler's doing
    ],
)
def test_needs_sync_mode__only_when_the_blamed_message_succeeds_on_its_own(
    blamed: Disposition, lost: bool, needs: bool
) -> None:
    messages = batch("ok", "ok")
    replayed = [(Disposition.HANDLED, 0.0), (blamed, 0.0)]
    assert needs_sync_mode(Broken(messages[1], "x", lost=lost), messages, replayed) is needs
    assert needs_sync_mode(Broken(None, "deadlock"), messages, replayed) is False


# -- the process on fakes ---------------------------------------------------------------------
def passes(inbox: Inbox, broker: FakeBroker, count: int) -> None:
    """What ``Inbox.run`` does per pass (drain, apply, retry held messages that are
    due), ``count`` times at most, until nothing is delivered or held."""
    for _ in range(count):
        deliveries = broker.drain(0)
        if deliveries:
            inbox._handle(deliveries)
        inbox._retry_due()
        inbox._apply_custody()
        if not deliveries and not inbox._held and not inbox.stats.custody_held:
            return


def test_inbox__acks_handled_holds_failed_and_parks_at_max_attempts() -> None:
    store = FakeStore()
    broker = FakeBroker([message("a", b"ok"), message("b", b"raise"), message("c", b"ok")])
    inbox = Inbox(act, SETTINGS_FOR_TESTS, broker=broker, connect_store=lambda _: store)
    inbox.start()
    passes(inbox, broker, 4)
    assert broker.ready == [] and broker.unacked == []
    assert not [j for j in broker.journal if j.startswith("reject")]  # never returned
    assert sorted(store.effects) == ["a", "c"]
    assert [p.message_id for p in store.parked] == ["b"]
    assert inbox.stats.retried == 1 and inbox.stats.parked == 1


# -- the promise, as a property ---------------------------------------------------------------
@given(
    st.lists(
        st.tuples(st.sampled_from(["ok", "ok", "ok", *FAILING]), st.integers(0, 5)),
        min_size=1,
        max_size=12,
    ),
    st.integers(1, 6),
)
def test_property__every_message_ends_in_exactly_one_place(
    mix: list[tuple[str, int]], prefetch: int
) -> None:
    """Ids may repeat (copies); the same id always carries the same behaviour."""
    behaviour_of = {}
    messages = []
    for behaviour, n in mix:
        key = f"m{n}"
        behaviour_of.setdefault(key, behaviour)
        messages.append(message(key, behaviour_of[key].encode()))
    store = FakeStore()
    broker = FakeBroker(messages, prefetch=prefetch)
    inbox = Inbox(act, SETTINGS_FOR_TESTS, broker=broker, connect_store=lambda _: store)
    inbox.start()
    passes(inbox, broker, 10 * len(messages))
    assert broker.ready == [] and broker.unacked == []
    parked = [p.message_id for p in store.parked]
    for key, behaviour in behaviour_of.items():
        if behaviour == "ok":
            assert store.effects.count(key) == 1 and key not in parked
        else:
            assert key not in store.effects and parked.count(key) == 1
    assert store.inbox == set(store.effects) | set(parked)


def test_settings__refuse_what_the_broker_would_refuse_later() -> None:
    from outbox.inbox.settings import MAX_PREFETCH, ConsumerSettings

    for bad in (
        {"prefetch": MAX_PREFETCH + 1},
        {"prefetch": 0},
        {"queue": "q" * 256},
        {"consumer_name": " "},
    ):
        with pytest.raises(ValueError):
            ConsumerSettings(**{"queue": "q", **bad})  # type: ignore[arg-type]
    # A queue we only consume may be server-named (amq.gen-…); only declaring it is refused.
    assert ConsumerSettings(queue="amq.gen-abc", prefetch=MAX_PREFETCH).prefetch == MAX_PREFETCH
