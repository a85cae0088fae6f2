"""The bytes of a persistent ``basic.publish``, encoded by hand (pure, no I/O).

pika builds a Basic.Publish, a BasicProperties and three Frame objects per
message and hands each frame to its transport separately (one send() each).
Profiling the relay showed that to be about half of its CPU time.  We encode the
same bytes directly (``encode_publish``, checked byte for byte against pika's own
marshalling by ``tests/unit/amqp/test_frames.py``) and the publisher writes
a whole run of messages at once.  The confirms coming back are decoded here too
(``leading_confirms``, checked against pika's frames by the same tests).  Only
pika's pure AMQP-table encoder is used here (``pika.data``); the I/O lives in
``outbox.amqp.publisher``.
"""

from __future__ import annotations

import datetime
import functools
import struct
from collections.abc import Mapping
from typing import Any, NamedTuple

import pika.data


class Message(NamedTuple):
    """One message to publish persistently (a tuple: one is made per row on the
    relay's hot path, and a frozen dataclass cost four times as much to build)."""

    exchange: str
    routing_key: str
    body: bytes | memoryview
    message_id: str
    content_type: str | None = None
    headers: Mapping[str, Any] | None = None
    timestamp: datetime.datetime | None = None


_FRAME_END = b"\xce"
_BASIC_PUBLISH = struct.pack(">HHH", 60, 40, 0)  # class basic, method publish, ticket
_FLAG_CONTENT_TYPE = 1 << 15
_FLAG_HEADERS = 1 << 13
_FLAG_DELIVERY_MODE = 1 << 12
_FLAG_MESSAGE_ID = 1 << 7
_FLAG_TIMESTAMP = 1 << 6
# Flush to the socket (and read confirms) after this many bytes of a batch, so the
# broker works on the start of a batch while we encode the rest.
FLUSH_BYTES = 128 * 1024
# Body frames carrying at least this many bytes are written as views of the
# message's body, not copies: a large payload is never copied on its way to the
# socket (pika queues what it writes until the socket takes it, so a copy would
# be held for the whole transfer).  Smaller bodies are copied into their frames,
# which keeps the writes of small messages few and large.
VIEW_BYTES = 16 * 1024

# What ``encode_publish`` returns and the publisher writes, in order: encoded
# frames (bytes) and views of message bodies between them.
Piece = bytes | memoryview


def _short_string(value: str) -> bytes:
    data = value.encode("utf-8")
    if len(data) > 255:
        raise ValueError(f"AMQP short string longer than 255 bytes: {value[:40]!r}…")
    return bytes((len(data),)) + data


def _frame(kind: int, channel: int, payload: bytes) -> bytes:
    return struct.pack(">BHI", kind, channel, len(payload)) + payload + _FRAME_END


@functools.lru_cache(maxsize=4096)
def _method_frame(channel: int, exchange: str, routing_key: str, mandatory: bool) -> bytes:
    """The ``basic.publish`` method frame: the same for every message to one exchange
    and routing key, so encoded once (a third of the encoding work of a small message)."""
    return _frame(
        1,
        channel,
        _BASIC_PUBLISH
        + _short_string(exchange)
        + _short_string(routing_key)
        + (b"\x01" if mandatory else b"\x00"),
    )


class FrameTooLarge(ValueError):
    """The properties (headers included) do not fit in one frame of the connection."""


def amqp_timestamp(moment: datetime.datetime) -> int:
    """Seconds since 1970 as AMQP carries them (unsigned 64 bits), or ValueError."""
    seconds = int(moment.timestamp())
    if seconds < 0:
        raise ValueError(f"timestamp {moment.isoformat()} is before 1970")
    return seconds


class _LastTimestamp:
    """``amqp_timestamp`` of the last moment seen, by identity.

    The rows of one transaction share their ``created_at`` (its ``now()``), and the
    claim loads equal values as one object (``outbox.db.rows``): converting an
    aware datetime was a twentieth of the relay's CPU per message."""

    last: tuple[datetime.datetime | None, int] = (None, 0)  # one object: thread-safe

    @classmethod
    def of(cls, moment: datetime.datetime) -> int:
        last = cls.last
        if last[0] is moment:
            return last[1]
        seconds = amqp_timestamp(moment)
        cls.last = (moment, seconds)
        return seconds


# Frame type, channel, size; then class, weight, body size and property flags.
_HEADER = struct.Struct(">BHIHHQH")
_HEADER_FIXED = 14  # class, weight, body size, flags
_BODY = struct.Struct(">BHI")
_TIMESTAMP = struct.Struct(">Q")


def encode_publish(
    channel: int,
    message: Message,
    *,
    mandatory: bool,
    body_max: int,
    frame_max: int | None = None,
) -> list[Piece]:
    """The frames of one persistent ``basic.publish`` (method, header, body), as
    pieces to write in order: one bytes object, or for a large body (see
    ``VIEW_BYTES``) the frames' headers and ends around views of the body.

    Properties and headers travel in one content-header frame: one larger than
    the connection's ``frame_max`` makes the broker close the whole connection
    (501 FRAME_ERROR), so it raises ``FrameTooLarge`` instead.
    """
    method = _method_frame(channel, message.exchange, message.routing_key, mandatory)
    flags = _FLAG_DELIVERY_MODE | _FLAG_MESSAGE_ID
    props = b""
    if message.content_type is not None:
        flags |= _FLAG_CONTENT_TYPE
        props = _short_string(message.content_type)
    if message.headers is not None:
        flags |= _FLAG_HEADERS
        table: list[bytes] = []
        pika.data.encode_table(table, dict(message.headers))
        props += b"".join(table)
    props += b"\x02" + _short_string(message.message_id)  # delivery_mode: persistent
    if message.timestamp is not None:
        flags |= _FLAG_TIMESTAMP
        props += _TIMESTAMP.pack(_LastTimestamp.of(message.timestamp))
    body = message.body
    size = len(body)
    header = _HEADER.pack(2, channel, _HEADER_FIXED + len(props), 60, 0, size, flags)
    if frame_max is not None and len(header) + len(props) + 1 > frame_max:
        raise FrameTooLarge(
            f"properties and headers need a frame of {len(header) + len(props) + 1} bytes, "
            f"more than the broker's frame_max ({frame_max}); AMQP sends them in one frame"
        )
    if size <= body_max and size < VIEW_BYTES:
        # The usual message: every frame in one bytes object, the body copied once.
        if not size:
            return [method + header + props + _FRAME_END]
        body_frame = _BODY.pack(3, channel, size)
        return [b"".join((method, header, props, _FRAME_END, body_frame, body, _FRAME_END))]
    if min(size, body_max) < VIEW_BYTES:
        frames: list[Piece] = [method, header, props, _FRAME_END]
        for start in range(0, size, body_max):
            part = body[start : start + body_max]
            frames += [_BODY.pack(3, channel, len(part)), part, _FRAME_END]
        return [b"".join(frames)]
    view = memoryview(body).cast("B")
    pieces: list[Piece] = []
    before = method + header + props + _FRAME_END
    for start in range(0, len(view), body_max):
        part = view[start : start + body_max]
        pieces += [before + _BODY.pack(3, channel, len(part)), part]
        before = _FRAME_END
    pieces.append(_FRAME_END)
    return pieces


def coalesce(pieces: list[Piece]) -> list[Piece]:
    """Join each run of encoded frames into one bytes object; views stay views."""
    out: list[Piece] = []
    run: list[bytes] = []
    for piece in pieces:
        if isinstance(piece, memoryview):
            if run:
                out.append(run[0] if len(run) == 1 else b"".join(run))
                run = []
            out.append(piece)
        else:
            run.append(piece)
    if run:
        out.append(run[0] if len(run) == 1 else b"".join(run))
    return out


# -- confirms, decoded by hand --------------------------------------------------------
# A ``basic.ack`` or ``basic.nack`` frame: type 1 (method), channel, payload size 13,
# class 60 (basic), method 80 (ack) or 120 (nack), delivery tag, one octet of bits
# (multiple; requeue for a nack), frame end.  RabbitMQ sends one per message or per
# run of messages: at a few messages per batch, pika's decoding and dispatching them
# (a Method object and a callback lookup each) was the largest share of the relay's
# CPU after the claim.
_CONFIRM_FRAME = struct.Struct(">BHIHHQBB")
CONFIRM_FRAME_SIZE = _CONFIRM_FRAME.size  # 21
_ACK, _NACK = 80, 120


class Confirm(NamedTuple):
    delivery_tag: int
    multiple: bool
    accepted: bool  # basic.ack; False: basic.nack


def leading_confirms(data: bytes | memoryview, channel: int) -> tuple[int, list[Confirm]]:
    """The ``basic.ack`` / ``basic.nack`` frames of ``channel`` at the start of
    ``data``: how many bytes they take, and what they say, in order.  Stops at the
    first byte that does not start such a frame (another frame, another channel, a
    frame cut short by the read): the caller hands the rest to pika as it is."""
    used, confirms = 0, []
    unpack, end = _CONFIRM_FRAME.unpack_from, len(data) - CONFIRM_FRAME_SIZE
    while used <= end:
        kind, number, size, klass, method, tag, bits, frame_end = unpack(data, used)
        if (
            kind != 1
            or number != channel
            or size != 13
            or klass != 60
            or (method != _ACK and method != _NACK)
            or frame_end != 0xCE
        ):
            break
        confirms.append(Confirm(tag, bool(bits & 1), method == _ACK))
        used += CONFIRM_FRAME_SIZE
    return used, confirms
