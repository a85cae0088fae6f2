"""Adversary: the consumer's new subscription (``Broker.resubscribe``) when the
broker connection drops in the middle of it."""

from __future__ import annotations

import uuid
from itertools import pairwise
from pathlib import Path
from typing import Any

import pika
import psycopg
import pytest

from outbox.amqp.consumer import Broker
from outbox.errors import OutboxError
from outbox.inbox.settings import ConsumerSettings
from tests.fixtures.faults import TcpProxy, proxied_amqp_url, wait_for
from tests.fixtures.servers import Topology
from tests.integration.inbox import support
from tests.integration.inbox.support import (
    INBOX,
    Consumer,
    consumer,
    effect_bodies,
    parked_bodies,
    publish,
    rows,
    wait_settled,
)
from tests.integration.inbox.test_queue_policies import redeclare

# basic.consume on the wire: class 60, method 20.
BASIC_CONSUME = b"\x00\x3c\x00\x14"


def test_resubscribe__a_connection_lost_on_consume_hands_out_none_of_its_deliveries(
    topology: Topology, amqp_proxy: TcpProxy
) -> None:
    """--prefetch 4: a drain takes 2 (the batch), the other 2 of the window arrive
    during basic.cancel and are kept for the next drain; the connection is then cut
    as basic.consume goes out.  Those 2 belong to the dead channel (they go back
    to the queue): after the reconnect every delivery handed out can be acked.
    Before, the 2 were kept past the outage and handed out first on the new
    connection, and their ack failed: another outage, and a redelivery counted
    against a quorum queue's delivery limit for every message in hand."""
    bodies = {f"m{i}".encode() for i in range(8)}
    publish(topology, [(str(uuid.uuid4()), body) for body in sorted(bodies)])
    url = proxied_amqp_url(topology.amqp_url, amqp_proxy)
    broker = Broker(ConsumerSettings(queue=topology.queue, amqp_url=url, prefetch=4))
    broker.open()
    try:
        while not broker.drain(timeout=2.0):
            pass
        amqp_proxy.arm(BASIC_CONSUME)
        with pytest.raises(OutboxError):
            broker.resubscribe()
        broker.open()
        acked: set[bytes] = set()
        for _ in range(20):
            for delivery in broker.drain(timeout=1.0):
                broker.settle(delivery, ack=True)
                acked.add(delivery.message.body)
            if acked == bodies:
                break
        assert acked == bodies
    finally:
        broker.close()


def _publish_keyed(topology: Topology, messages: list[tuple[str, bytes]]) -> None:
    ch = topology.channel()
    ch.confirm_delivery()
    for key, body in messages:
        properties = pika.BasicProperties(
            delivery_mode=2, message_id=str(uuid.uuid4()), headers={"x-ordering-key": key}
        )
        ch.basic_publish("", topology.queue, body, properties)
    ch.connection.close()


@pytest.mark.parametrize(
    ("arguments", "prefetch"),
    [({}, 4), ({}, 1), ({"x-queue-type": "quorum", "x-delivery-limit": 2}, 4)],
    ids=["classic", "classic_prefetch_1", "quorum_limit_2"],
)
def test_resubscribe__many_keys_a_few_failing_each_key_in_order_nothing_lost(
    tmp_path: Path, consumer_dsn: str, topology: Topology, arguments: dict[str, Any], prefetch: int
) -> None:
    """300 ordering keys, two messages each; the first message of 12 keys fails
    until parked (--max-attempts 3, 1 s apart), --prefetch 4 (or 1): the consumer
    subscribes again and again while it holds those and their keys' second
    messages.  Every healthy message is applied once, a failing key's second
    message only after its first is parked, nothing is left on the queue, and on
    a quorum queue with x-delivery-limit 2 nothing is dropped.  And at --prefetch 1."""
    if arguments:
        redeclare(topology, arguments)
    failing = {f"k{i}" for i in range(0, 300, 25)}
    messages = [
        (f"k{i}", f"{'raise' if n == 0 and f'k{i}' in failing else 'ok'}:k{i}:{n}".encode())
        for n in range(2)
        for i in range(300)
    ]
    _publish_keyed(topology, messages)
    env = {"OUTBOX_RETRY_DELAY": "1", "OUTBOX_RETRY_DELAY_MAX": "1"}
    with consumer(
        tmp_path, consumer_dsn, topology, max_attempts=3, prefetch=prefetch, env=env
    ) as c:
        wait_settled(consumer_dsn, topology, [body for _, body in messages], timeout=50)
        assert "consumer.resubscribed" in c.output()
    effects = effect_bodies(consumer_dsn)
    assert sorted(effects) == sorted(body for _, body in messages if body.startswith(b"ok"))
    assert sorted(parked_bodies(consumer_dsn)) == sorted(
        body for _, body in messages if body.startswith(b"raise")
    )
    parked_at = dict(rows(consumer_dsn, f"SELECT body, parked_at FROM {INBOX}_parked"))
    applied_at = dict(rows(consumer_dsn, "SELECT body, at FROM effects"))
    for key in failing:
        assert applied_at[f"ok:{key}:1".encode()] >= parked_at[f"raise:{key}:0".encode()]
    for i in range(300):
        if f"k{i}" not in failing:
            assert applied_at[f"ok:k{i}:0".encode()] <= applied_at[f"ok:k{i}:1".encode()]


def test_resubscribe__a_consumer_killed_holding_messages_of_several_subscriptions_loses_none(
    tmp_path: Path, consumer_dsn: str, topology: Topology
) -> None:
    """kill -9 of a consumer that holds failing messages (and their keys' next ones)
    delivered through several subscriptions: they all come back, the next consumer
    applies every healthy message once, in key order, and parks the failing ones."""
    failing = {f"k{i}" for i in range(0, 100, 10)}
    messages = [
        (f"k{i}", f"{'raise' if n == 0 and f'k{i}' in failing else 'ok'}:k{i}:{n}".encode())
        for n in range(2)
        for i in range(100)
    ]
    _publish_keyed(topology, messages)
    env = {"OUTBOX_RETRY_DELAY": "30", "OUTBOX_RETRY_DELAY_MAX": "30"}
    first = Consumer(tmp_path, consumer_dsn, topology, max_attempts=3, prefetch=4, env=env)
    try:
        first.started()
        wait_for(
            lambda: first.output().count("consumer.resubscribed") >= 3,
            30,
            "the first consumer to subscribe again",
        )
        first.kill()
    finally:
        first.close()
    env = {"OUTBOX_RETRY_DELAY": "0.5", "OUTBOX_RETRY_DELAY_MAX": "0.5"}
    with consumer(tmp_path, consumer_dsn, topology, max_attempts=3, prefetch=4, env=env):
        wait_settled(consumer_dsn, topology, [body for _, body in messages], timeout=40)
    effects = effect_bodies(consumer_dsn)
    assert sorted(effects) == sorted(body for _, body in messages if body.startswith(b"ok"))
    assert sorted(parked_bodies(consumer_dsn)) == sorted(
        body for _, body in messages if body.startswith(b"raise")
    )
    for i in range(100):
        if f"k{i}" not in failing:
            assert effects.index(f"ok:k{i}:0".encode()) < effects.index(f"ok:k{i}:1".encode())


def test_resubscribe__connections_cut_after_subscribing_again_lose_nothing(
    tmp_path: Path, consumer_dsn: str, topology: Topology, amqp_proxy: TcpProxy
) -> None:
    """The broker connection cut three times, each right after the consumer
    subscribed again while holding failing messages and their keys' next ones:
    what it held comes back, every healthy message is applied once, in key order,
    and the failing ones are parked."""
    failing = {f"k{i}" for i in range(0, 100, 10)}
    messages = [
        (f"k{i}", f"{'raise' if n == 0 and f'k{i}' in failing else 'ok'}:k{i}:{n}".encode())
        for n in range(2)
        for i in range(100)
    ]
    env = {
        "OUTBOX_RETRY_DELAY": "1",
        "OUTBOX_RETRY_DELAY_MAX": "1",
        "OUTBOX_AMQP_URL": proxied_amqp_url(topology.amqp_url, amqp_proxy),
    }
    with consumer(tmp_path, consumer_dsn, topology, max_attempts=4, prefetch=4, env=env) as c:
        _publish_keyed(topology, messages)
        for cut in range(1, 4):
            wait_for(
                lambda cut=cut: c.output().count("consumer.resubscribed") >= 2 * cut,
                20,
                "the consumer to subscribe again",
            )
            amqp_proxy.cut_all()
        wait_settled(consumer_dsn, topology, [body for _, body in messages], timeout=40)
        assert c.output().count("consumer.retry") >= 3
    effects = effect_bodies(consumer_dsn)
    assert sorted(effects) == sorted(body for _, body in messages if body.startswith(b"ok"))
    assert sorted(parked_bodies(consumer_dsn)) == sorted(
        body for _, body in messages if body.startswith(b"raise")
    )
    for i in range(100):
        if f"k{i}" not in failing:
            assert effects.index(f"ok:k{i}:0".encode()) < effects.index(f"ok:k{i}:1".encode())


FAILS_ONCE = r'''

def fails_once(conn, message):
    """Bodies starting with ``once`` fail their first attempt (noted on a session
    of its own, which the rollback leaves alone), then are applied."""
    if message.body.startswith(b"once"):
        with psycopg.connect(os.environ["OUTBOX_DSN"], autocommit=True) as own:
            own.execute("CREATE TABLE IF NOT EXISTS failed_once (body bytea PRIMARY KEY)")
            noted = own.execute(
                "INSERT INTO failed_once VALUES (%s) ON CONFLICT DO NOTHING", [message.body]
            ).rowcount
        if noted:
            raise RuntimeError("the first attempt fails")
    record(conn, message)
'''


def test_resubscribe__a_single_active_consumer_queue_keeps_a_keys_order_across_a_retry(
    tmp_path: Path, consumer_dsn: str, topology: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ordered set-up of docs/how-to/consuming.md: a queue with
    x-single-active-consumer, two consumers (one for failover), --prefetch 1.  Key
    K's first message fails once and is held for its retry; K's second must be
    applied after it.  Subscribing again to make room would cancel the active
    consumer, so RabbitMQ makes the waiting one active, and it applied K's second
    message while the first waited for its retry in the other's hands."""
    monkeypatch.setattr(support, "HANDLERS", support.HANDLERS + FAILS_ONCE)
    redeclare(topology, {"x-single-active-consumer": True})
    env = {"OUTBOX_RETRY_DELAY": "2", "OUTBOX_RETRY_DELAY_MAX": "2"}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    options: dict[str, Any] = {"function": "fails_once", "max_attempts": 5, "prefetch": 1}
    with (
        consumer(tmp_path / "a", consumer_dsn, topology, env=env, **options) as active,
        consumer(tmp_path / "b", consumer_dsn, topology, env=env, **options),
    ):
        _publish_keyed(topology, [("K", b"once:K:1"), ("K", b"ok:K:2")])
        wait_settled(consumer_dsn, topology, [b"once:K:1", b"ok:K:2"], timeout=30)
        assert "x-single-active-consumer" in active.output()
    assert effect_bodies(consumer_dsn) == [b"once:K:1", b"ok:K:2"]


NOTES_DELIVERIES = r'''

FIRST_FAILED = {}


def noting_deliveries(conn, message):
    """Bodies starting with ``once`` fail for 0.2 s from their first attempt (one
    consumer process, never killed: noted in memory), so each is held in hand for
    its retry; each effect notes whether the broker delivered its message more
    than once (the redelivered flag, an ``x-delivery-count``)."""
    if message.body.startswith(b"once"):
        if time.monotonic() - FIRST_FAILED.setdefault(message.body, time.monotonic()) < 0.2:
            raise RuntimeError("fails for a while")
    record(conn, message)
    conn.execute(
        "INSERT INTO receipts VALUES (%s, %s, %s)",
        [message.body, message.redelivered, message.headers.get("x-delivery-count")],
    )
'''


def test_resubscribe__a_quorum_queue_with_keys_gets_no_redelivery_and_no_inversion(
    tmp_path: Path, consumer_dsn: str, topology: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One consumer, no fault: a quorum queue with x-delivery-limit 20, 10 ordering
    keys of 60 messages each, one message in 12 failing for 0.2 s (held in hand for
    its retry 0.3 s later, its key's later messages behind it), --prefetch 4: the
    consumer subscribes again and again to make room.  Every message is applied
    once, in its key's order, and none is delivered twice.  Before, each cancel
    handed back to the queue what was on its way to the cancelled subscription
    (the broker's side of the channel returns a delivery for a tag it no longer
    knows): a delivery counted against the limit with no fault, and the message
    handed out again, sometimes after later messages of its key (in 7 runs: 37
    to 67 of 600 redelivered, 1 to 12 inversions)."""
    monkeypatch.setattr(support, "HANDLERS", support.HANDLERS + NOTES_DELIVERIES)
    redeclare(topology, {"x-queue-type": "quorum", "x-delivery-limit": 20})
    with psycopg.connect(consumer_dsn) as conn:
        conn.execute("CREATE TABLE receipts (body bytea, redelivered bool, delivery_count int)")
    keys, per_key = 10, 60
    messages = [
        (f"k{k}", f"{'once' if (n * keys + k) % 12 == 5 else 'ok'}:k{k}:{n}".encode())
        for n in range(per_key)
        for k in range(keys)
    ]
    env = {"OUTBOX_RETRY_DELAY": "0.3", "OUTBOX_RETRY_DELAY_MAX": "0.3"}
    options: dict[str, Any] = {"function": "noting_deliveries", "max_attempts": 5}
    with consumer(tmp_path, consumer_dsn, topology, prefetch=4, env=env, **options) as c:
        _publish_keyed(topology, messages)
        wait_settled(consumer_dsn, topology, [body for _, body in messages], timeout=60)
        resubscribed = c.output().count("consumer.resubscribed")
    effects = effect_bodies(consumer_dsn)
    redelivered = rows(
        consumer_dsn, "SELECT body FROM receipts WHERE redelivered OR delivery_count > 0"
    )
    order: dict[str, list[int]] = {}
    for body in effects:
        _, key, n = body.decode().split(":")
        order.setdefault(key, []).append(int(n))
    inversions = sum(1 for ns in order.values() for before, after in pairwise(ns) if after < before)
    figures = (
        f"{resubscribed} resubscribes, {len(redelivered)} of {len(messages)} effects "
        f"redelivered, {inversions} inversions"
    )
    assert resubscribed >= 10, figures
    assert (len(redelivered), inversions) == (0, 0), figures
    assert sorted(effects) == sorted(body for _, body in messages), figures
    assert parked_bodies(consumer_dsn) == []
