"""Issue 21: a batch takes at most half the prefetch, so the next batch is already on
the connection while one commits; its multiple ack settles only what was handed on."""

from __future__ import annotations

from outbox.amqp.consumer import Broker
from tests.fixtures.faults import wait_for
from tests.fixtures.servers import Topology
from tests.integration.inbox.test_inbox import (
    consumer_settings,
    new_ids,
    publish,
    ready_messages,
)


def test_drain__takes_half_the_prefetch_and_the_rest_waits_on_the_connection(
    topology: Topology,
) -> None:
    ids = new_ids(10)
    publish(topology, [(i, b"x") for i in ids])
    broker = Broker(consumer_settings(topology, "postgresql://unused", prefetch=10))
    broker.open()
    try:
        # All 10 sent to the consumer before it takes any: none is left on the queue.
        wait_for(lambda: ready_messages(topology) == 0, 10, "the prefetch to be delivered")
        first = broker.drain(timeout=1.0)
        assert [d.message.message_id for d in first] == ids[:5]
        # Nothing was acked, so the prefetch (10) is full and the broker sends nothing
        # more: the second batch is the rest of what already came, no refill.
        second = broker.drain(timeout=5.0)
        assert [d.message.message_id for d in second] == ids[5:]
        # The first batch's one multiple ack leaves the second batch unacked.
        broker.settle(first[-1], ack=True, multiple=True)
    finally:
        broker.close()
    wait_for(lambda: ready_messages(topology) == 5, 10, "the second batch back on the queue")
    back = [props.message_id for _, props, _ in topology.messages()]
    assert sorted(back) == sorted(ids[5:])
