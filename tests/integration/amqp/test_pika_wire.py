"""The publisher's fast path through pika's private members, against the real broker."""

from __future__ import annotations

from outbox.amqp.confirms import Outcome
from outbox.amqp.frames import Message
from outbox.amqp.publisher import Publisher, _Wire
from tests.fixtures.servers import Topology


def test_wire__body_larger_than_a_frame_arrives_whole(topology: Topology) -> None:
    publisher = Publisher(topology.amqp_url)
    publisher.connect()
    try:
        conn = publisher._conn
        assert conn is not None
        body_max = _Wire.body_max(conn)
        assert body_max == publisher.frame_max - 8  # type: ignore[operator]
        bodies = [bytes([i]) * (body_max * 3 + i) for i in range(3)]
        deliveries = publisher.publish(
            [Message(topology.exchange, "k", body, f"m{i}") for i, body in enumerate(bodies)],
            timeout=10,
        )
        assert [d.outcome for d in deliveries] == [Outcome.ACCEPTED] * 3
    finally:
        publisher.close()
    assert [b for _, _, b in topology.messages()] == bodies
