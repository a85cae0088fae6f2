"""Confirms that pika dispatches (``Publisher._on_confirm``), without a broker."""

from __future__ import annotations

import types

from pika import frame, spec

from outbox.amqp.confirms import Delivery, Outcome, Pending
from outbox.amqp.frames import Message
from outbox.amqp.publisher import Publisher


def test_on_confirm__ignores_a_confirm_of_a_channel_it_no_longer_publishes_on() -> None:
    """After a confirm timeout the channel is abandoned, but pika still dispatches its
    acks until the broker answers the close: they must not settle the tags of the
    channel that replaces it."""
    publisher = Publisher("amqp://guest:guest@127.0.0.1:5672/%2F")
    pending = Pending([Delivery(sent=True)])
    publisher._confirms.track(pending, [0], [Message("x", "k", b"", "m")])
    ack = frame.Method(1, spec.Basic.Ack(delivery_tag=1))

    publisher._on_confirm(ack)  # no channel: the old one was abandoned
    publisher._channel = types.SimpleNamespace(channel_number=2)
    publisher._on_confirm(ack)  # another channel's
    assert not pending.settled

    publisher._channel = types.SimpleNamespace(channel_number=1)
    publisher._on_confirm(ack)
    assert pending.settled and pending.deliveries[0].outcome is Outcome.ACCEPTED
