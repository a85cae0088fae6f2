"""Confirm/return bookkeeping never keys on message_id (issue 9, item 1)."""

from __future__ import annotations

import collections
import datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox.amqp.confirms import Confirms, Delivery, Outcome, Pending, Unconfirmed, match_return
from outbox.amqp.frames import FrameTooLarge, Message, Piece, amqp_timestamp, encode_publish

SHARED = "33333333-3333-3333-3333-333333333331"


def channel(*messages: Message) -> collections.OrderedDict[int, Unconfirmed]:
    pending = Pending([Delivery(sent=True) for _ in messages], outstanding=len(messages))
    return collections.OrderedDict(
        (tag, Unconfirmed(pending, delivery, message))
        for tag, (delivery, message) in enumerate(
            zip(pending.deliveries, messages, strict=True), start=1
        )
    )


def test_match_return__two_rows_sharing_an_id_are_told_apart_by_destination() -> None:
    on_channel = channel(
        Message("x", "k", b"before", "a"),
        Message("", "q", b"to-queue", SHARED),
        Message("", "nowhere", b"unroutable", SHARED),
        Message("x", "k", b"after", "b"),
    )
    assert match_return(on_channel, 0, "", "nowhere", SHARED, b"unroutable") == 3


def test_match_return__identical_destinations_are_told_apart_by_order() -> None:
    """Returns come in publish order: the second return is the second such message."""
    on_channel = channel(*[Message("", "nowhere", b"same", SHARED) for _ in range(3)])
    first = match_return(on_channel, 0, "", "nowhere", SHARED, b"same")
    assert first == 1
    on_channel[1].delivery.outcome = Outcome.RETURNED
    assert match_return(on_channel, first, "", "nowhere", SHARED, b"same") == 2


def test_match_return__skips_messages_given_up_or_confirmed() -> None:
    on_channel = channel(Message("", "q", b"1", "m"), Message("", "q", b"1", "m"))
    on_channel[1].delivery.reason = "channel closed: 406 …"
    assert match_return(on_channel, 0, "", "q", "m", b"1") == 2
    del on_channel[2]
    assert match_return(on_channel, 0, "", "q", "m", b"2") is None


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["", "x"]), st.sampled_from(["q", "nowhere"]), st.binary(max_size=2)
        ),
        min_size=1,
        max_size=12,
    ),
    st.data(),
)
def test_match_return__every_returned_message_is_found_in_order(
    sent: list[tuple[str, str, bytes]], data: st.DataObject
) -> None:
    """The broker returns a subset of the published messages, in publish order: each
    return marks exactly the message it came from, or one identical to it."""
    messages = [Message(ex, rk, body, SHARED) for ex, rk, body in sent]
    on_channel = channel(*messages)
    returned = sorted(data.draw(st.sets(st.integers(1, len(messages)))))
    last = 0
    for tag in returned:
        m = messages[tag - 1]
        found = match_return(on_channel, last, m.exchange, m.routing_key, m.message_id, m.body)
        assert found is not None and found <= tag
        assert messages[found - 1] == m
        on_channel[found].delivery.outcome = Outcome.RETURNED
        last = found
    marked = [t for t, e in on_channel.items() if e.delivery.outcome is Outcome.RETURNED]
    assert [messages[t - 1] for t in marked] == [messages[t - 1] for t in returned]


def test_encode_publish__properties_over_frame_max_are_refused_not_sent() -> None:
    big = Message("x", "k", b"", "id", headers={"big": "v" * 200_000})
    with pytest.raises(FrameTooLarge, match=r"frame_max \(131072\)"):
        encode_publish(1, big, mandatory=True, body_max=131064, frame_max=131072)
    small = Message("x", "k", b"b" * 300_000, "id", headers={"h": "v"})
    assert encode_publish(1, small, mandatory=True, body_max=131064, frame_max=131072)


def header_frame_length(pieces: list[Piece]) -> int:
    """Length of the second frame (the content header), frame header and end included."""
    frames = b"".join(pieces)
    method_end = 7 + int.from_bytes(frames[3:7], "big") + 1
    return 7 + int.from_bytes(frames[method_end + 3 : method_end + 7], "big") + 1


@given(st.integers(0, 5000))
def test_encode_publish__a_header_frame_of_exactly_frame_max_fits(fill: int) -> None:
    """RabbitMQ's rule: a frame's payload is at most frame_max - 8 bytes, so the
    whole frame (7 bytes before, 1 after) is at most frame_max."""
    message = Message("x", "k", b"body", "id", headers={"h": "v" * fill})
    length = header_frame_length(encode_publish(1, message, mandatory=True, body_max=100))
    encode_publish(1, message, mandatory=True, body_max=100, frame_max=length)
    with pytest.raises(FrameTooLarge):
        encode_publish(1, message, mandatory=True, body_max=100, frame_max=length - 1)


@pytest.mark.parametrize(
    ("moment", "seconds"),
    [
        (datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc), 0),
        (datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.timezone.utc), 253402300799),
    ],
)
def test_amqp_timestamp__range_ends(moment: datetime.datetime, seconds: int) -> None:
    assert amqp_timestamp(moment) == seconds


def test_amqp_timestamp__before_1970_is_refused_not_crashed() -> None:
    with pytest.raises(ValueError, match="before 1970"):
        amqp_timestamp(datetime.datetime(1, 1, 1, tzinfo=datetime.timezone.utc))


def test_confirms__a_pending_send_counts_its_nacks() -> None:
    """``Publisher.confirmed`` replaces a nacking channel by that count alone."""
    messages = [Message("x", "k", b"%d" % i, "m") for i in range(5)]
    pending = Pending([Delivery() for _ in messages])
    confirms = Confirms()
    confirms.track(pending, range(5), messages)
    confirms.confirm(2, multiple=True, accepted=True)
    confirms.confirm(4, multiple=True, accepted=False)
    confirms.confirm(5, multiple=False, accepted=True)
    assert pending.settled and pending.nacked == 2
    assert [d.outcome for d in pending.deliveries] == [Outcome.ACCEPTED] * 2 + [
        Outcome.NACKED
    ] * 2 + [Outcome.ACCEPTED]
