"""The heartbeat thread, against an in-memory control session: a probe after the
relay lost its work session finds a lost control session at once, not at the next
beat."""

from __future__ import annotations

import time
from typing import cast

from outbox.db.relays import ControlSession
from outbox.errors import DatabaseUnavailable
from outbox.relay.liveness import Liveness

INTERVAL = 60.0  # no beat of its own during a test: only probes beat


class FakeControl:
    def __init__(self) -> None:
        self.relay_id = "0" * 32
        self.broken = False
        self.beats = 0
        self.closed = False
        self.fail_next = False

    def heartbeat(self) -> None:
        self.beats += 1
        if self.fail_next:
            self.broken = True
            raise DatabaseUnavailable("server closed the connection unexpectedly")

    def unregister(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def started(control: FakeControl) -> Liveness:
    liveness = Liveness(cast(ControlSession, control), INTERVAL)
    liveness._thread.start()
    return liveness


def test_probe__a_control_session_gone_with_the_server_is_lost_at_once() -> None:
    control = FakeControl()
    liveness = started(control)
    try:
        # The restart ended it; nothing has used it since, so nothing knows yet
        # (``broken`` turns true only once a statement fails on it).
        control.fail_next = True
        before = time.monotonic()
        liveness.probe(timeout=5.0)
        assert liveness._lost.is_set(), "the probe did not find the session gone"
        assert time.monotonic() - before < 5.0
        assert control.beats == 1
    finally:
        liveness.stop(unregister=False)


def test_probe__a_live_control_session_beats_and_stays_ours() -> None:
    control = FakeControl()
    liveness = started(control)
    try:
        old = liveness.last_ok
        time.sleep(0.01)
        liveness.probe(timeout=5.0)
        assert control.beats == 1
        assert liveness.last_ok > old
        assert not liveness.lost
    finally:
        liveness.stop(unregister=False)
    assert control.closed


def test_probe__never_waits_for_a_stopped_thread() -> None:
    control = FakeControl()
    liveness = started(control)
    liveness.stop(unregister=False)
    before = time.monotonic()
    liveness.probe(timeout=5.0)
    assert time.monotonic() - before < 1.0


def test_stop__wakes_the_thread_at_once() -> None:
    liveness = started(FakeControl())
    before = time.monotonic()
    liveness.stop(unregister=False)
    assert time.monotonic() - before < 2.0  # not after INTERVAL
    assert not liveness._thread.is_alive()
