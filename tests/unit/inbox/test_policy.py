"""Issue 31: the queue's own policies (pure decisions in ``outbox.amqp.policy`` and
``planning.plan``), failed messages held in hand instead of holding the queue, and
pipelining that survives a lost session, on the in-memory fakes."""

from __future__ import annotations

import dataclasses
import random

import pytest

from outbox.amqp.message import InboxMessage
from outbox.amqp.policy import (
    QueuePolicy,
    inequivalent,
    may_subscribe_again,
    policy_from,
    refusal,
)
from outbox.db.inbox import InboxRowHeld
from outbox.inbox.custody import to_take
from outbox.inbox.planning import Disposition
from outbox.inbox.process import HAND_MOST, Inbox
from outbox.inbox.settings import ConsumerSettings
from outbox.inbox.stats import ConsumerStats
from outbox.inbox.steps import Processor
from tests.unit.inbox.fakes import FakeBroker, FakeConnection, FakeStore, message
from tests.unit.inbox.test_loop import act, passes

SETTINGS = ConsumerSettings(queue="q", max_attempts=5, retry_delay=0.0)


# -- reading the queue's arguments from a refused declare ------------------------------------
@pytest.mark.parametrize(
    ("text", "found"),
    [
        (
            "PRECONDITION_FAILED - inequivalent arg 'x-delivery-limit' for queue 'q' in vhost "
            "'/': received '-7' but current is '2'",
            ("x-delivery-limit", 2),
        ),
        (
            "PRECONDITION_FAILED - inequivalent arg 'x-delivery-limit' for queue 'q' in vhost "
            "'/': received none but current is the value '2' of type 'signedint'",
            ("x-delivery-limit", 2),
        ),
        (
            "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'q' in vhost '/': "
            "received 'outbox-probe' but current is 'stream'",
            ("x-queue-type", "stream"),
        ),
        (
            "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'q' in vhost '/': "
            "received the value 'outbox-probe' of type 'longstr' but current is none",
            ("x-queue-type", None),
        ),
        (
            "PRECONDITION_FAILED - inequivalent arg 'x-dead-letter-exchange' for queue 'q' in "
            "vhost '/': received none but current is the value '' of type 'longstr'",
            ("x-dead-letter-exchange", ""),
        ),
        (
            "PRECONDITION_FAILED - inequivalent arg 'durable' for queue 'q' in vhost '/': "
            "received 'true' but current is 'false'",
            ("durable", "false"),
        ),
        # A boolean comes back as one, or the next declare (a string 'true') is
        # refused again, and the queue's arguments are never all read.
        (
            "PRECONDITION_FAILED - inequivalent arg 'x-single-active-consumer' for queue 'q' in "
            "vhost '/': received none but current is the value 'true' of type 'bool'",
            ("x-single-active-consumer", True),
        ),
        (
            "PRECONDITION_FAILED - inequivalent arg 'x-single-active-consumer' for queue 'q' in "
            "vhost '/': received 'outbox-probe' but current is 'true'",
            ("x-single-active-consumer", True),
        ),
        ("ACCESS_REFUSED - access to queue 'q' in vhost '/' refused for user 'app'", None),
    ],
)
def test_inequivalent__names_the_argument_and_its_current_value(
    text: str, found: tuple[str, object] | None
) -> None:
    assert inequivalent(text) == found


def test_policy_from__rabbitmq_4_gives_quorum_queues_a_limit_of_20() -> None:
    quorum = {"x-queue-type": "quorum"}
    assert policy_from(quorum, stated_limit=None, broker_version="3.10.8").delivery_limit is None
    assert policy_from(quorum, stated_limit=None, broker_version="4.0.2").delivery_limit == 20
    assert policy_from({}, stated_limit=None, broker_version="4.0.2").delivery_limit is None
    assert policy_from(quorum, stated_limit=7, broker_version="4.0.2").delivery_limit == 7
    limited = {**quorum, "x-delivery-limit": 3}
    assert policy_from(limited, stated_limit=None, broker_version="4.1.0").delivery_limit == 3


def test_refusal__a_stream_and_a_delivery_limit_of_0() -> None:
    assert "stream" in (refusal(QueuePolicy("stream")) or "")
    assert "0" in (refusal(QueuePolicy("quorum", delivery_limit=0)) or "")
    assert refusal(QueuePolicy("quorum", delivery_limit=1)) is None
    assert refusal(QueuePolicy("classic", message_ttl=10)) is None


# -- the process --------------------------------------------------------------------------------
def quorum(limit: int) -> FakeBroker:
    broker = FakeBroker([], prefetch=20)
    broker.policy = QueuePolicy("quorum", delivery_limit=limit)
    return broker


def redelivered(message_id: str, body: bytes, count: int) -> InboxMessage:
    return message(message_id, body, redelivered=True, headers={"x-delivery-count": count})


def test_inbox__returned_messages_are_taken_into_custody_before_any_handler_runs() -> None:
    """In a crash loop every message in hand comes back and counts; those the broker
    returned are stored and acked in one transaction before any handler can kill
    the process, then applied from custody: the killer, whose earlier attempts never
    finished, is parked there, and the healthy ones are applied."""
    store = FakeStore()
    store.attempts["killer"] = 5  # counted before the calls that killed the consumer
    broker = quorum(3)
    broker.ready = [
        redelivered("a", b"ok", 3),
        redelivered("killer", b"fatal", 1),
        redelivered("b", b"ok", 2),
    ]
    inbox = Inbox(act, SETTINGS, broker=broker, connect_store=lambda _: store)
    inbox.start()
    inbox._handle(broker.drain(0))
    assert store.effects == []  # no handler ran yet
    assert broker.journal == ["ack a", "ack killer", "ack b"]
    assert [row["message_id"] for row in store.custody] == ["a", "killer", "b"]
    passes(inbox, broker, 3)
    assert sorted(store.effects) == ["a", "b"]
    assert [p.message_id for p in store.parked] == ["killer"]
    assert store.custody == []


def test_inbox__a_message_in_custody_that_fails_waits_there_and_holds_its_key() -> None:
    """A message in custody whose handler raises waits in the table for its retry
    delay, and the later messages of its ordering key, taken into custody behind
    it, wait for it; a message of another key goes on."""
    store = FakeStore()
    broker = quorum(2)
    settings = dataclasses.replace(SETTINGS, retry_delay=60.0, retry_delay_max=60.0)
    keyed = {"x-ordering-key": "K", "x-delivery-count": 1}
    broker.ready = [
        message("k1", b"raise", redelivered=True, headers=keyed, ordering_key="K"),
        message("other", b"ok", redelivered=True, headers={"x-delivery-count": 1}),
    ]
    inbox = Inbox(act, settings, broker=broker, connect_store=lambda _: store)
    inbox.start()
    passes(inbox, broker, 1)
    assert store.effects == ["other"]
    # k2 is a first delivery, but k1 of its key is in custody: it goes behind it.
    broker.ready = [message("k2", b"ok", headers={"x-ordering-key": "K"}, ordering_key="K")]
    passes(inbox, broker, 2)
    assert store.effects == ["other"]
    assert [row["message_id"] for row in store.custody] == ["k1", "k2"]
    assert broker.unacked == []  # the broker holds none of them
    assert store.attempts["k1"] == 1


def test_custody__to_take_keeps_a_key_behind_its_message_held_in_hand() -> None:
    """While custody holds messages, keyed first deliveries go into it too, except
    those of a key whose earlier message waits in hand for its retry: they wait
    behind it there.  A returned message always goes in."""
    policy = QueuePolicy("quorum", delivery_limit=2)
    k = message("k", headers={"x-ordering-key": "K"}, ordering_key="K")
    j = message("j", headers={"x-ordering-key": "J"}, ordering_key="J")
    plain = message("p")
    back = redelivered("r", b"ok", 1)
    assert to_take([k, j, plain], policy, held=False) == [False, False, False]
    assert to_take([k, j, plain], policy, held=True) == [True, True, False]
    assert to_take([k, j, plain, back], policy, held=False) == [True, True, False, True]
    assert to_take([k, j], policy, held=True, waiting_keys={"K"}) == [False, True]
    assert to_take([back], QueuePolicy("classic"), held=True) == [False]
    assert to_take([message(None, redelivered=True)], policy, held=True) == [False]


def test_inbox__a_copy_of_a_message_applied_before_is_not_taken_into_custody() -> None:
    store = FakeStore()
    store.inbox.add("a")
    broker = quorum(2)
    broker.ready = [redelivered("a", b"ok", 1)]
    inbox = Inbox(act, SETTINGS, broker=broker, connect_store=lambda _: store)
    inbox.start()
    passes(inbox, broker, 2)
    assert store.custody == [] and store.effects == []
    assert broker.journal == ["ack a"]


def test_inbox__no_custody_on_a_queue_that_drops_nothing() -> None:
    """A classic queue (or a quorum queue without a limit) never drops a returned
    message: it is applied as before, alone, and nothing is stored."""
    store = FakeStore()
    broker = FakeBroker([redelivered("a", b"ok", 1)])
    broker.policy = QueuePolicy("quorum")
    inbox = Inbox(act, SETTINGS, broker=broker, connect_store=lambda _: store)
    inbox.start()
    passes(inbox, broker, 2)
    assert store.effects == ["a"]
    assert not any(line.startswith("take_custody") for line in store.journal)


def test_inbox__a_failed_message_is_held_in_hand_while_the_others_go_on() -> None:
    store = FakeStore()
    broker = FakeBroker([message("bad", b"raise"), message("a", b"ok")])
    settings = dataclasses.replace(SETTINGS, retry_delay=60.0, retry_delay_max=60.0)
    inbox = Inbox(act, settings, broker=broker, connect_store=lambda _: store)
    inbox.start()
    inbox._handle(broker.drain(0))
    broker.ready.append(message("b", b"ok"))
    inbox._handle(broker.drain(0))
    inbox._retry_due()  # not due for a minute
    assert store.effects == ["a", "b"]
    assert [d.message.message_id for d in broker.unacked] == ["bad"]
    # Acked one by one: a multiple ack would also ack the held message.
    assert broker.journal == ["ack a", "ack b"]
    assert inbox._drain_timeout() == 1.0


def test_inbox__more_messages_in_hand_than_the_prefetch_do_not_stop_the_others() -> None:
    """Prefetch 4, six failing messages waiting a minute each, then healthy ones:
    once the messages in hand take half the subscription's slots the consumer
    subscribes again, so the healthy ones are delivered and applied at once; it
    keeps at most ``HAND_MOST`` x prefetch unacked."""
    store = FakeStore()
    failing = [message(f"bad{i}", b"raise") for i in range(6)]
    broker = FakeBroker([*failing, message("a", b"ok"), message("b", b"ok")], prefetch=4)
    broker.policy = QueuePolicy("classic")
    settings = dataclasses.replace(SETTINGS, prefetch=4, retry_delay=60.0, retry_delay_max=60.0)
    inbox = Inbox(act, settings, broker=broker, connect_store=lambda _: store)
    inbox.start()
    for _ in range(4):
        inbox._handle(broker.drain(0))
        inbox._make_room()
    assert store.effects == ["a", "b"]
    assert len(inbox._held) == 6 and broker.journal.count("resubscribe") == 2
    # A hand full: no more room made.
    broker.ready += [message(f"more{i}", b"raise") for i in range(20)]
    for _ in range(10):
        inbox._handle(broker.drain(0))
        inbox._make_room()
    assert 2 * 4 < len(inbox._held) <= len(broker.unacked) <= HAND_MOST * 4
    made = broker.journal.count("resubscribe")
    inbox._handle(broker.drain(0))
    inbox._make_room()
    assert broker.journal.count("resubscribe") == made


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_inbox__never_more_than_hand_most_times_prefetch_unacked(
    chaos_seed: int, queue_type: str
) -> None:
    """Most messages fail (retried in a minute), some share ordering keys, and a
    drain takes only part of the window (the rest is on its way, unacked, as from
    a real socket): at no point more than ``HAND_MOST`` x prefetch unacked.
    Before, a resubscribe counted only the messages in hand, not those of the
    current subscription still on their way: up to 4.67 x prefetch 3.  On a
    quorum queue (acks kept back until the window is in hand) also no cancel
    that hands a delivery back to the queue."""
    rng = random.Random(chaos_seed)
    for _ in range(200):
        prefetch = rng.randint(1, 9)
        keys = [None, *(f"k{i}" for i in range(rng.randint(0, 6)))]
        messages = [
            message(f"m{i}", rng.choice([b"raise", b"raise", b"ok"]), ordering_key=rng.choice(keys))
            for i in range(12 * prefetch)
        ]
        broker = FakeBroker(messages, prefetch=prefetch, per_drain=rng.randint(1, prefetch))
        broker.policy = QueuePolicy(queue_type)
        settings = dataclasses.replace(
            SETTINGS, prefetch=prefetch, retry_delay=60.0, retry_delay_max=60.0
        )
        inbox = Inbox(act, settings, broker=broker, connect_store=lambda _: FakeStore())
        inbox.start()
        for _ in range(8 * prefetch):
            deliveries = broker.drain(0)
            if deliveries:
                inbox._handle(deliveries)
            inbox._make_room()
            assert len(broker.unacked) <= HAND_MOST * prefetch, (prefetch, broker.per_drain)
        assert broker.returned == 0


def test_inbox__on_a_quorum_queue_a_cancel_waits_for_the_whole_window_in_hand() -> None:
    """Prefetch 4, two failing messages (held a minute) and healthy ones behind
    them on a quorum queue: the held ones take half the window, but a cancel now
    would hand back to the queue what is on its way to the subscription (a
    delivery counted against the limit, and a key reordered).  The consumer
    keeps back the acks of the healthy ones applied meanwhile until all 4 slots
    are in hand, subscribes again, then acks them.  Before, it subscribed again
    with 2 slots free."""
    store = FakeStore()
    failing = [message(f"bad{i}", b"raise") for i in range(2)]
    healthy = [message(f"ok{i}", b"ok") for i in range(10)]
    broker = FakeBroker([*failing, *healthy], prefetch=4)
    broker.policy = QueuePolicy("quorum", delivery_limit=20)
    settings = dataclasses.replace(SETTINGS, prefetch=4, retry_delay=60.0, retry_delay_max=60.0)
    inbox = Inbox(act, settings, broker=broker, connect_store=lambda _: store)
    inbox.start()
    for _ in range(8):
        deliveries = broker.drain(0)
        if deliveries:
            inbox._handle(deliveries)
        inbox._make_room()
    assert broker.returned == 0
    assert broker.journal.count("resubscribe") >= 1
    assert store.effects == [m.message_id for m in healthy]
    assert [d.message.message_id for d in broker.unacked] == ["bad0", "bad1"]
    assert broker.held_acks is None


@pytest.mark.parametrize(
    "policy",
    [QueuePolicy("classic", single_active_consumer=True), QueuePolicy()],
    ids=["single_active_consumer", "unknown"],
)
def test_inbox__no_new_subscription_on_a_single_active_consumer_queue(policy: QueuePolicy) -> None:
    """On a queue with x-single-active-consumer (or one whose arguments are unknown)
    the held messages keep their slots: a cancel would make the next consumer in
    line active, and it would apply the later messages of a held message's key."""
    failing = [message(f"bad{i}", b"raise", ordering_key="k") for i in range(4)]
    broker = FakeBroker([*failing, message("a", b"ok", ordering_key="k")], prefetch=4)
    broker.policy = policy
    settings = dataclasses.replace(SETTINGS, prefetch=4, retry_delay=60.0, retry_delay_max=60.0)
    inbox = Inbox(act, settings, broker=broker, connect_store=lambda _: FakeStore())
    inbox.start()
    for _ in range(4):
        inbox._handle(broker.drain(0))
        inbox._make_room()
    assert "resubscribe" not in broker.journal
    assert may_subscribe_again(QueuePolicy("quorum"))
    assert policy_from(
        {"x-single-active-consumer": "true"}, stated_limit=None
    ).single_active_consumer


def test_inbox__a_keyed_failed_message_holds_its_key_only() -> None:
    store = FakeStore()
    keyed = {"ordering_key": "k"}
    broker = FakeBroker(
        [message("k1", b"raise", **keyed), message("k2", b"ok", **keyed), message("x", b"ok")]
    )
    settings = dataclasses.replace(SETTINGS, max_attempts=2)
    inbox = Inbox(act, settings, broker=broker, connect_store=lambda _: store)
    inbox.start()
    inbox._handle(broker.drain(0))
    assert store.effects == ["x"]  # k2 waits behind k1
    broker.ready.append(message("k3", b"ok", **keyed))
    inbox._handle(broker.drain(0))
    assert store.effects == ["x"]  # k3 too
    passes(inbox, broker, 3)  # k1 fails again and is parked; k2, k3 follow in order
    assert store.effects == ["x", "k2", "k3"]
    assert [p.message_id for p in store.parked] == ["k1"]
    assert broker.unacked == []


def test_processor__a_lost_session_leaves_pipelining_on() -> None:
    """The server ends the session in the middle of a pipelined batch (a restart,
    pg_terminate_backend); the batch is applied one by one and every message
    succeeds.  Before, that turned pipelining off for the rest of the process."""
    store = FakeStore()
    lost: list[str] = []

    def handler(conn: FakeConnection, msg: InboxMessage) -> None:
        conn.apply(str(msg.message_id))
        if not lost:
            lost.append(str(msg.message_id))
            conn.lose_session()

    processor = Processor(store, handler, SETTINGS, ConsumerStats())
    outcomes = processor.process_batch([message("a"), message("b")])
    assert [o for o, _ in outcomes] == [Disposition.HANDLED] * 2
    assert processor.pipelining


def test_inbox__a_message_still_failing_near_the_consumer_timeout_is_parked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A held message whose next attempt would come after ``MAX_HOLD`` in hand (15
    minutes; 0 here) is parked with the reason, not held into RabbitMQ's
    consumer_timeout (which would close the channel and return everything in hand)."""
    from outbox.inbox import planning

    monkeypatch.setattr(planning, "MAX_HOLD", 0.0)
    store = FakeStore()
    broker = FakeBroker([message("bad", b"raise"), message("a", b"ok")])
    inbox = Inbox(act, SETTINGS, broker=broker, connect_store=lambda _: store)
    inbox.start()
    passes(inbox, broker, 3)
    assert store.effects == ["a"]
    assert [p.message_id for p in store.parked] == ["bad"]
    assert "consumer_timeout" in store.parked[0].error
    assert store.attempts.get("bad") is None  # parked: its count is gone with it
    assert broker.unacked == []


def test_inbox__a_message_in_custody_whose_inbox_row_is_held_stays_in_custody() -> None:
    """Its id's inbox row held by another transaction at the record step: it waits in
    custody (no attempt counted), never released from it."""
    store = FakeStore()
    broker = quorum(2)
    broker.ready = [redelivered("a", b"ok", 1)]
    inbox = Inbox(act, SETTINGS, broker=broker, connect_store=lambda _: store)
    inbox.start()
    inbox._handle(broker.drain(0))
    store.fail_next["record_ids"] = InboxRowHeld("held by another transaction")
    inbox._apply_custody()
    assert [row["message_id"] for row in store.custody] == ["a"]
    assert store.effects == []
    assert "release_custody a" not in store.journal
