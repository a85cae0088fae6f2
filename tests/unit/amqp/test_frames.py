"""``encode_publish`` writes exactly the bytes pika's own marshalling would."""

from __future__ import annotations

import datetime
from typing import Any

import pika
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pika import frame, spec

from outbox.amqp.frames import (
    CONFIRM_FRAME_SIZE,
    VIEW_BYTES,
    Confirm,
    Message,
    coalesce,
    encode_publish,
    leading_confirms,
)

short = st.text(max_size=60)
header_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(short, inner, max_size=3),
    max_leaves=8,
)


def pika_bytes(channel: int, message: Message, body_max: int) -> bytes:
    props = pika.BasicProperties(
        delivery_mode=2,
        message_id=message.message_id,
        content_type=message.content_type,
        headers=dict(message.headers) if message.headers is not None else None,
        timestamp=int(message.timestamp.timestamp()) if message.timestamp else None,
    )
    parts = [
        frame.Method(
            channel,
            spec.Basic.Publish(
                exchange=message.exchange, routing_key=message.routing_key, mandatory=True
            ),
        ).marshal(),
        frame.Header(channel, len(message.body), props).marshal(),
    ]
    for start in range(0, len(message.body), body_max):
        parts.append(frame.Body(channel, message.body[start : start + body_max]).marshal())
    return b"".join(parts)


@given(
    channel=st.integers(1, 2047),
    exchange=short,
    routing_key=short,
    body=st.binary(max_size=300),
    message_id=short,
    content_type=st.none() | short,
    headers=st.none() | st.dictionaries(short, header_values, max_size=4),
    timestamp=st.none()
    | st.datetimes(
        min_value=datetime.datetime(1970, 1, 2), timezones=st.just(datetime.timezone.utc)
    ),
    body_max=st.integers(1, 200),
)
def test_encode_publish__matches_pika(
    channel: int,
    exchange: str,
    routing_key: str,
    body: bytes,
    message_id: str,
    content_type: str | None,
    headers: dict[str, Any] | None,
    timestamp: datetime.datetime | None,
    body_max: int,
) -> None:
    message = Message(exchange, routing_key, body, message_id, content_type, headers, timestamp)
    pieces = encode_publish(channel, message, mandatory=True, body_max=body_max)
    assert b"".join(pieces) == pika_bytes(channel, message, body_max)


@given(
    size=st.sampled_from([VIEW_BYTES - 1, VIEW_BYTES, 131064, 131064 * 3 + 7]),
    body_max=st.sampled_from([VIEW_BYTES - 1, VIEW_BYTES, 131064]),
    as_view=st.booleans(),
)
def test_encode_publish__a_large_body_travels_as_views_of_itself_never_copied(
    size: int, body_max: int, as_view: bool
) -> None:
    raw = bytes(range(256)) * (size // 256) + bytes(size % 256)
    body: bytes | memoryview = memoryview(raw) if as_view else raw
    message = Message("ex", "k", body, "id", headers={"h": "v"})
    pieces = encode_publish(7, message, mandatory=True, body_max=body_max)
    assert b"".join(pieces) == pika_bytes(
        7, Message("ex", "k", raw, "id", headers={"h": "v"}), body_max
    )
    views = [p for p in pieces if isinstance(p, memoryview)]
    if min(size, body_max) < VIEW_BYTES:
        assert views == [] and len(pieces) == 1  # small: one bytes object
    else:
        assert sum(len(v) for v in views) == size
        assert all(v.obj is raw for v in views), "a view of the body, not of a copy"
        # Between the views: a frame's end and the next frame's header (8 bytes).
        assert all(len(p) <= 8 for p in pieces[1:] if not isinstance(p, memoryview))
    # What the publisher hands to pika: frames joined, views left alone.
    joined = coalesce([*pieces, *pieces])
    assert b"".join(joined) == b"".join(pieces) * 2
    assert [p for p in joined if isinstance(p, memoryview)] == views * 2


def test_encode_publish__rejects_a_routing_key_longer_than_255_bytes() -> None:
    message = Message("ex", "k" * 256, b"", "id")
    with pytest.raises(ValueError, match="255"):
        encode_publish(1, message, mandatory=True, body_max=100)


def test_encode_publish__each_message_carries_its_own_timestamp() -> None:
    """The last AMQP timestamp is remembered by identity (rows of one transaction
    share one ``created_at`` object): an equal moment as another object, a later
    one, and the first again each encode their own seconds."""
    utc = datetime.timezone.utc
    first = datetime.datetime(2024, 5, 1, 10, 0, tzinfo=utc)
    moments = [first, first, datetime.datetime(2024, 5, 1, 10, 0, tzinfo=utc)]
    moments += [first + datetime.timedelta(seconds=1), first]
    for moment in moments:
        message = Message("ex", "k", b"body", "id", timestamp=moment)
        pieces = encode_publish(1, message, mandatory=True, body_max=100)
        assert b"".join(pieces) == pika_bytes(1, message, 100)


# -- confirms decoded by hand ----------------------------------------------------------
def confirm_frame(channel: int, tag: int, multiple: bool, accepted: bool) -> bytes:
    method = (
        spec.Basic.Ack(delivery_tag=tag, multiple=multiple)
        if accepted
        else spec.Basic.Nack(delivery_tag=tag, multiple=multiple, requeue=not multiple)
    )
    return bytes(frame.Method(channel, method).marshal())


tags = st.integers(0, 2**64 - 1)
# Frames that must stop the run: a confirm of another channel, a heartbeat, a
# basic.return, a channel.close.
others = st.sampled_from(
    [
        confirm_frame(2, 7, False, True),
        bytes(frame.Heartbeat().marshal()),
        bytes(frame.Method(1, spec.Basic.Return(312, "NO_ROUTE", "x", "k")).marshal()),
        bytes(frame.Method(1, spec.Channel.Close(406, "PRECONDITION_FAILED", 0, 0)).marshal()),
        bytes(frame.Method(1, spec.Basic.Deliver("c", 5, False, "x", "k")).marshal()),
    ]
)


@given(
    confirms=st.lists(st.tuples(tags, st.booleans(), st.booleans()), max_size=8),
    after=st.lists(others, max_size=3),
    cut=st.integers(0, 25),
)
def test_leading_confirms__reads_exactly_pikas_frames_and_stops_at_anything_else(
    confirms: list[tuple[int, bool, bool]], after: list[bytes], cut: int
) -> None:
    data = b"".join(confirm_frame(1, *c) for c in confirms) + b"".join(after)
    data = data[: max(0, len(data) - cut)]  # a read may end inside a frame
    used, read = leading_confirms(data, 1)
    whole = min(len(confirms), len(data) // CONFIRM_FRAME_SIZE)
    assert used == whole * CONFIRM_FRAME_SIZE
    assert [tuple(c) for c in read] == confirms[:whole]


def test_leading_confirms__a_confirm_of_another_channel_stops_the_run() -> None:
    data = confirm_frame(1, 1, False, True) + confirm_frame(3, 2, False, True)
    assert leading_confirms(data, 1) == (CONFIRM_FRAME_SIZE, [Confirm(1, False, True)])
    assert leading_confirms(data, 3) == (0, [])
