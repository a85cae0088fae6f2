"""``broker.BufferedFrames``: AMQP frames parsed from one buffer, whatever pieces the
socket hands them in, and py-amqp's own reads wherever its private transport is not
as expected."""

from __future__ import annotations

import errno
import socket
import struct
from types import SimpleNamespace
from typing import Any

import pytest
from amqp.exceptions import UnexpectedFrame
from amqp.transport import SSLTransport, TCPTransport

from outbox.amqp.consumer import BufferedFrames


def frame(frame_type: int, channel: int, payload: bytes, end: int = 0xCE) -> bytes:
    return struct.pack(">BHI", frame_type, channel, len(payload)) + payload + bytes([end])


class Socket:
    """Hands out ``pieces`` one per ``recv`` (an exception in it is raised), then
    raises ``BlockingIOError`` as a non-blocking socket with nothing to read."""

    def __init__(self, pieces: list[Any]) -> None:
        self.pieces = list(pieces)
        self.asked: list[int] = []

    def recv(self, size: int) -> bytes:
        self.asked.append(size)
        if not self.pieces:
            raise BlockingIOError(errno.EAGAIN, "nothing yet")
        piece = self.pieces.pop(0)
        if isinstance(piece, BaseException):
            raise piece
        assert len(piece) <= size
        return bytes(piece)


def reader(pieces: list[Any], leftover: bytes = b"") -> tuple[BufferedFrames, Any]:
    transport = SimpleNamespace(sock=Socket(pieces), _read_buffer=leftover, connected=True)
    return BufferedFrames(transport), transport


FRAMES = [
    (1, 1, b"method" * 3),
    (2, 1, b"header"),
    (3, 1, b"x" * 1000),
    (8, 0, b""),  # a heartbeat
    (3, 2, bytes(range(256)) * 3),
]
WIRE = b"".join(frame(*f) for f in FRAMES)


def test_read_frame__many_frames_from_one_recv() -> None:
    frames, transport = reader([WIRE])
    assert [frames.read_frame() for _ in FRAMES] == FRAMES
    assert len(transport.sock.asked) == 1
    with pytest.raises(TimeoutError):  # nothing more: a timeout, not an error
        frames.read_frame()
    assert transport.connected


@pytest.mark.parametrize("cut", [1, 2, 7, 8, 13, 30, 1000, len(WIRE) - 1])
def test_read_frame__a_frame_split_anywhere_is_completed_by_the_next_call(cut: int) -> None:
    """Each piece is followed by a timeout (the socket had nothing more): what was
    read stays in the buffer and the next call completes the frame."""
    frames, transport = reader([WIRE[:cut]])
    got = []
    pieces = [p for p in (WIRE[cut : cut + 5], WIRE[cut + 5 :]) if p]
    timeouts = 0
    while len(got) < len(FRAMES):
        try:
            got.append(frames.read_frame())
        except TimeoutError:
            timeouts += 1
            transport.sock.pieces.append(pieces.pop(0))
    assert got == FRAMES
    assert timeouts >= 1 and not pieces


def test_read_frame__byte_by_byte() -> None:
    frames, _ = reader([WIRE[i : i + 1] for i in range(len(WIRE))])
    assert [frames.read_frame() for _ in FRAMES] == FRAMES


def test_read_frame__a_frame_larger_than_one_chunk() -> None:
    big = (3, 1, b"y" * (BufferedFrames.chunk * 2 + 17))
    wire = frame(*big) + frame(8, 0, b"")
    pieces = [wire[i : i + 40000] for i in range(0, len(wire), 40000)]
    frames, _ = reader(pieces)
    assert frames.read_frame() == big
    assert frames.read_frame() == (8, 0, b"")


def test_read_frame__starts_with_what_py_amqp_read_before() -> None:
    frames, transport = reader([WIRE[10:]], leftover=WIRE[:10])
    assert transport._read_buffer == b""
    assert [frames.read_frame() for _ in FRAMES] == FRAMES


def test_read_frame__a_socket_timeout_keeps_the_partial_frame() -> None:
    frames, _ = reader([WIRE[:20], TimeoutError("timed out"), WIRE[20:]])
    with pytest.raises(TimeoutError):
        frames.read_frame()
    assert [frames.read_frame() for _ in FRAMES] == FRAMES


def test_read_frame__the_broker_closing_the_connection_is_an_os_error() -> None:
    frames, transport = reader([WIRE[:20], b""])
    with pytest.raises(OSError, match="closed"):
        frames.read_frame()
    assert transport.connected is False


def test_read_frame__a_reset_connection_is_an_os_error() -> None:
    frames, transport = reader([ConnectionResetError(errno.ECONNRESET, "reset")])
    with pytest.raises(ConnectionResetError):
        frames.read_frame()
    assert transport.connected is False


def test_read_frame__a_closed_transport_is_an_os_error() -> None:
    frames, transport = reader([])
    transport.sock = None
    with pytest.raises(OSError):
        frames.read_frame()


def test_read_frame__a_bad_frame_end_is_refused() -> None:
    frames, _ = reader([frame(1, 1, b"abc", end=0x00)])
    with pytest.raises(UnexpectedFrame):
        frames.read_frame()


def test_install__on_py_amqp_plain_tcp_transport() -> None:
    transport = TCPTransport("localhost:5672")
    transport.sock = socket.socket()
    try:
        assert BufferedFrames.install(transport)
        assert isinstance(transport.read_frame.__self__, BufferedFrames)
    finally:
        transport.sock.close()


def test_install__falls_back_to_py_amqp_where_its_transport_is_not_as_expected() -> None:
    """TLS, no socket yet, a py-amqp without the private buffer, another object:
    py-amqp keeps reading its own way."""
    tls = SSLTransport("localhost:5671")
    tls.sock = socket.socket()
    bare = TCPTransport("localhost:5672")  # not connected: no socket
    no_buffer = TCPTransport("localhost:5672")
    no_buffer.sock = socket.socket()
    del no_buffer._read_buffer
    try:
        for transport in (tls, bare, no_buffer, SimpleNamespace(sock=None), None):
            before = getattr(transport, "read_frame", None)
            assert not BufferedFrames.install(transport)
            assert getattr(transport, "read_frame", None) == before
    finally:
        tls.sock.close()
        no_buffer.sock.close()
