"""pika's private members behind ``publisher._Wire``: a pika upgrade that renames or
changes them must fail here, not in production."""

from __future__ import annotations

import inspect

import pika.connection
from pika.adapters.select_connection import SelectConnection


def test_pika__connection_writes_marshaled_frames_in_one_call() -> None:
    write = SelectConnection._output_marshaled_frames
    assert list(inspect.signature(write).parameters) == ["self", "marshaled_frames"]
    # It is the end of pika's own send path, so it frames nothing itself.
    assert "_output_marshaled_frames" in inspect.getsource(pika.connection.Connection._send_message)


def test_pika__body_max_length_is_frame_max_minus_frame_overhead() -> None:
    source = inspect.getsource(pika.connection.Connection)
    assert "self._body_max_length = self._get_body_frame_max_length()" in source

    class Tuned:
        params = pika.ConnectionParameters(frame_max=131072)

    body_max = pika.connection.Connection._get_body_frame_max_length(Tuned())  # type: ignore[arg-type]
    assert body_max == 131072 - 8  # 7 bytes of frame header, 1 frame-end byte


def test_pika__reads_reach_the_connection_through_on_data_available() -> None:
    """``_Wire.take_confirms`` replaces ``_on_data_available`` on the instance: pika
    must look it up at each read, buffer partial frames in ``_frame_buffer``, and
    count bytes and frames where its heartbeat checker and we expect."""
    from pika.adapters.base_connection import BaseConnection

    assert "self._on_data_available(data)" in inspect.getsource(BaseConnection._proto_data_received)
    receive = inspect.getsource(pika.connection.Connection._on_data_available)
    assert "self._frame_buffer += data_in" in receive
    assert "self._trim_frame_buffer(consumed_count)" in receive
    assert "self.bytes_received += byte_count" in inspect.getsource(
        pika.connection.Connection._trim_frame_buffer
    )
    assert "self.frames_received += 1" in inspect.getsource(
        pika.connection.Connection._process_frame
    )
    assert "bytes_received" in inspect.getsource(pika.heartbeat.HeartbeatChecker)


def test_pika__the_transport_and_its_socket_are_where_wire_quiet_looks() -> None:
    from pika.adapters.base_connection import BaseConnection
    from pika.adapters.utils.io_services_utils import _AsyncTransportBase

    assert "self._transport = None" in inspect.getsource(BaseConnection)
    assert "self._sock = sock" in inspect.getsource(_AsyncTransportBase.__init__)
    assert "_tx_buffered_byte_count" in inspect.getsource(_AsyncTransportBase.get_write_buffer_size)


def test_pika__a_plain_transport_writes_its_buffer_when_told_the_socket_is_writable() -> None:
    from pika.adapters.utils.io_services_utils import _AsyncPlaintextTransport

    source = inspect.getsource(_AsyncPlaintextTransport._on_socket_writable)
    assert "self._produce()" in source
    assert "self._nbio.remove_writer(" in source
