"""``StopFlag.fileno``: a dormant relay sleeps on it (``outbox.relay.process``)."""

from __future__ import annotations

import select

from outbox.relay.process import StopFlag


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_stop_flag__its_descriptor_turns_readable_once_set() -> None:
    stop = StopFlag()
    fd = stop.fileno()
    assert not readable(fd) and not stop
    stop.set()
    stop.set()  # twice: still one readable descriptor, never blocking
    assert readable(fd) and stop


def test_stop_flag__set_before_the_descriptor_is_asked_for() -> None:
    stop = StopFlag()
    stop.set()
    assert readable(stop.fileno())
