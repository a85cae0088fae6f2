"""Adversary: the consumer's new subscription (``Broker.resubscribe``) when the
broker connection drops in the middle of it."""

from __future__ import annotations

import uuid

import pytest

from outbox.errors import OutboxError
from outbox.inbox.broker import Broker
from outbox.inbox.settings import ConsumerSettings
from tests.fixtures.faults import TcpProxy, proxied_amqp_url
from tests.fixtures.servers import Topology
from tests.integration.inbox.support import publish

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
