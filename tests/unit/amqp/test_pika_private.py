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
