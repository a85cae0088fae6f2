"""The publisher's fast path through pika's private members, against the real broker."""

from __future__ import annotations

import time
import uuid

from outbox.amqp.confirms import Outcome
from outbox.amqp.frames import CONFIRM_FRAME_SIZE, Message, encode_publish
from outbox.amqp.publisher import Publisher, _Wire
from tests.fixtures.servers import Topology
from tests.fixtures.wire import count_decoded_confirms


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


def test_wire__confirms_decoded_by_hand_settle_every_message_and_count_as_traffic(
    topology: Topology,
) -> None:
    """Confirm frames at the head of a read bypass pika (``_Wire.take_confirms``): every
    message is still settled with its own outcome, and the bytes read are counted for
    pika's heartbeat checker."""
    publisher = Publisher(topology.amqp_url)
    decoded = count_decoded_confirms(publisher)
    publisher.connect()
    try:
        conn = publisher._conn
        assert conn is not None
        received = conn.bytes_received
        outcomes = []
        for batch in range(20):
            messages = [
                Message(topology.exchange, "k", b"x", f"m{batch}-{i}") for i in range(batch % 7 + 1)
            ]
            # The default exchange, to a queue that does not exist: returned.
            messages.append(Message("", f"no-queue-{uuid.uuid4()}", b"x", f"r{batch}"))
            outcomes += [d.outcome for d in publisher.publish(messages, timeout=10)]
        assert outcomes.count(Outcome.RETURNED) == 20
        assert outcomes.count(Outcome.ACCEPTED) == sum(b % 7 + 1 for b in range(20))
        assert sum(decoded) > 0, "no confirm took the fast path"
        assert conn.bytes_received - received >= sum(decoded) * CONFIRM_FRAME_SIZE
    finally:
        publisher.close()
    assert len(topology.messages()) == sum(b % 7 + 1 for b in range(20))


def test_wire__quiet_until_a_write_is_buffered_or_a_frame_arrives(topology: Topology) -> None:
    """``_Wire.quiet`` lets ``collect_confirms`` skip a pass of the I/O loop: it must
    say no while a write waits in pika's buffer or bytes wait on the socket."""
    publisher = Publisher(topology.amqp_url)
    publisher.connect()
    try:
        conn = publisher._conn
        assert conn is not None
        assert _Wire.quiet(conn)
        channel = publisher._channel
        _Wire.write(
            conn,
            encode_publish(
                channel.channel_number,
                Message(topology.exchange, "k", b"x", "q1"),
                mandatory=True,
                body_max=_Wire.body_max(conn),
                frame_max=publisher.frame_max,
            ),
        )
        assert not _Wire.quiet(conn)  # buffered by pika, not yet on the socket
        deadline = time.monotonic() + 10
        publisher._run_until(lambda: False, 0.0)  # written; its confirm will arrive
        while _Wire.quiet(conn) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _Wire.quiet(conn), "the confirm waiting on the socket was not seen"
    finally:
        publisher.close()


def test_wire__send_puts_a_small_batch_on_the_socket_before_it_returns(
    topology: Topology,
) -> None:
    """``send`` writes through ``_Wire.flush`` (no pass of the I/O loop): the broker has
    the batch while the relay goes on, and the confirms come as before."""
    publisher = Publisher(topology.amqp_url)
    publisher.connect()
    try:
        conn = publisher._conn
        assert conn is not None
        pending = publisher.send(
            [Message(topology.exchange, "k", b"x" * 100, f"f{i}") for i in range(20)]
        )
        assert conn._transport.get_write_buffer_size() == 0
        deliveries = publisher.confirmed(pending, timeout=10)
        assert [d.outcome for d in deliveries] == [Outcome.ACCEPTED] * 20
    finally:
        publisher.close()
    assert len(topology.messages()) == 20
