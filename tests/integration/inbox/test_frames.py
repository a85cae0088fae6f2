"""The consumer's buffered frame reader against a real broker, and py-amqp's own
reads where it is not installed: the same deliveries either way, bodies larger
than a frame included, and heartbeats through an idle spell."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest

from outbox.amqp.consumer import Broker, BufferedFrames
from tests.fixtures.servers import Topology
from tests.integration.inbox.test_inbox import consumer_settings, new_ids, publish


@contextlib.contextmanager
def opened(broker: Broker, *, buffered: bool) -> Iterator[Broker]:
    """``broker`` open, reading through ``BufferedFrames`` or py-amqp's own reads."""
    broker.open()
    try:
        assert broker.conn is not None
        reader = getattr(broker.conn.connection.transport.read_frame, "__self__", None)
        assert isinstance(reader, BufferedFrames) is buffered
        yield broker
    finally:
        broker.close()


@pytest.fixture(params=[True, False], ids=["buffered", "py-amqp"])
def buffered(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    if not request.param:  # as with a py-amqp whose transport is not as expected
        monkeypatch.setattr(BufferedFrames, "install", classmethod(lambda cls, t: None))
    return bool(request.param)


def test_drain__every_delivery_whole_with_and_without_the_buffered_reader(
    topology: Topology, buffered: bool
) -> None:
    ids = new_ids(60)
    # Bodies from empty to several frames long (frame_max is 128 KiB).
    bodies = [bytes([i % 251]) * (i * 7919 % 400_000 if i % 5 else i) for i in range(len(ids))]
    publish(topology, list(zip(ids, bodies, strict=True)))
    broker = Broker(consumer_settings(topology, "postgresql://unused", prefetch=20))
    with opened(broker, buffered=buffered):
        got = []
        deadline = time.monotonic() + 30
        while len(got) < len(ids) and time.monotonic() < deadline:
            batch = broker.drain(timeout=1.0)
            if batch:
                broker.settle(batch[-1], ack=True, multiple=True)
            got += batch
    assert [d.message.message_id for d in got] == ids
    assert [d.message.body for d in got] == bodies


def test_drain__heartbeats_keep_an_idle_connection(topology: Topology, buffered: bool) -> None:
    broker = Broker(consumer_settings(topology, "postgresql://unused", heartbeat=2))
    with opened(broker, buffered=buffered):
        # The broker sends a heartbeat each second and closes the connection after
        # two intervals without one from the consumer: 5 s with nothing else.
        idle_until = time.monotonic() + 5
        while time.monotonic() < idle_until:
            assert broker.drain(timeout=0.5) == []
        ids = new_ids(3)
        publish(topology, [(i, b"after the idle spell") for i in ids])
        got = []
        deadline = time.monotonic() + 10
        while len(got) < len(ids) and time.monotonic() < deadline:
            got += broker.drain(timeout=1.0)
        assert [d.message.message_id for d in got] == ids
        assert broker.connected
