"""The private members of py-amqp and kombu that the consumer's broker adapter
(``outbox.amqp.consumer``) relies on, against the local RabbitMQ: an upgrade that
renames or changes one fails here (and in both corners of ``.ci/matrix``), not in a
consumer.  The frame reader's (``BufferedFrames``) are pinned in ``test_frames.py``
and ``tests/unit/inbox/test_frames.py``."""

from __future__ import annotations

import contextlib
import inspect
import time
import uuid
from collections.abc import Iterator
from typing import Any

import amqp.exceptions
import pytest
from kombu.connection import Connection
from kombu.transport import pyamqp

from outbox.amqp.consumer import Broker, Delivery, _Channel
from outbox.amqp.message import inbox_key
from tests.fixtures.servers import Topology
from tests.integration.inbox.support import publish
from tests.integration.inbox.test_inbox import consumer_settings, new_ids


@contextlib.contextmanager
def drained(
    topology: Topology, count: int, **settings: Any
) -> Iterator[tuple[Broker, list[Delivery]]]:
    """An open ``Broker`` and the ``count`` deliveries it drained, none settled."""
    broker = Broker(consumer_settings(topology, "postgresql://unused", **settings))
    broker.open()
    try:
        got: list[Delivery] = []
        deadline = time.monotonic() + 20
        while len(got) < count and time.monotonic() < deadline:
            got += broker.drain(timeout=1.0)
        yield broker, got
    finally:
        broker.close()


@pytest.mark.parametrize(
    ("channel_class", "reopened"),
    [(pyamqp.Channel, True), (_Channel, False)],
    ids=["py-amqp", "outbox"],
)
def test_py_amqp__a_channel_the_broker_closes_is_revived_through_do_revive(
    topology: Topology, channel_class: type[pyamqp.Channel], reopened: bool
) -> None:
    """py-amqp reopens a channel the broker closed (``Channel._do_revive``), which
    ``_Channel`` overrides to leave it closed; a py-amqp that revives some other
    way, or a kombu that opens channels without ``Connection.Channel``, fails the
    ``outbox`` case."""
    conn = Connection(topology.amqp_url, connect_timeout=5)
    conn.connect()
    try:
        conn.connection.Channel = channel_class  # as ``Broker.open`` installs it
        channel = conn.channel()
        with pytest.raises(amqp.exceptions.NotFound):
            channel.queue_declare(queue=f"t.missing.{uuid.uuid4().hex}", passive=True)
        assert isinstance(channel, channel_class)
        assert channel.is_open is reopened
    finally:
        conn.release()


def test_kombu__the_subscriptions_tag_is_the_one_its_deliveries_carry(
    topology: Topology,
) -> None:
    """``Broker`` reads its subscription's tag from kombu's ``Consumer._active_tags``:
    every delivery must count as the subscription's (``--prefetch``'s window)."""
    publish(topology, [(i, b"x") for i in new_ids(3)])
    with drained(topology, 3, prefetch=3) as (broker, got):
        assert len(got) == 3
        assert all(broker.subscribed(d) for d in got)
        assert broker.window_in_hand()  # the prefetch window is the three in hand


def test_py_amqp__a_delivery_keeps_its_raw_properties_and_an_id_that_is_not_utf8(
    topology: Topology,
) -> None:
    """``_Delivery`` decodes the property list itself (``Message._load_properties``):
    an id that is not UTF-8, which py-amqp's own decoding raises on, arrives, and
    the list's bytes are kept for ``outbox parked retry``."""
    message_id = b"\xff\xfe-not-utf8"
    publish(topology, [(message_id, b"body")], headers={"h": "v"})
    with drained(topology, 1) as (_, got):
        assert [d.message.message_id for d in got] == [inbox_key(message_id)]
        raw = got[0].message.raw_properties
        assert raw is not None and message_id in raw


def test_py_amqp__publish_confirm_selects_confirms_unless_confirm_selected() -> None:
    """``QueuePublisher`` selects confirms itself (its wait bounded by
    ``connect_timeout``), then sets ``Channel._confirm_selected`` so that
    ``basic_publish_confirm`` does not select them again, unbounded."""
    source = inspect.getsource(amqp.Channel.basic_publish_confirm)
    assert "if not self._confirm_selected:" in source
