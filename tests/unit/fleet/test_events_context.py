"""Every event a fleet target's threads emit names its database: the thread's event
context (``outbox.events.context``), taken over by the heartbeat thread."""

from __future__ import annotations

import logging
import threading

import pytest

from outbox.errors import DatabaseUnavailable
from outbox.events import context, current_context, emit
from outbox.relay.liveness import Liveness


def test_context__adds_its_fields_to_this_threads_events_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logging.getLogger("outbox.test")
    caplog.set_level(logging.INFO)
    with context(database="orders"):
        emit(log, "inside", n=1)
        other = threading.Thread(target=lambda: emit(log, "other thread"))
        other.start()
        other.join()
        assert current_context() == {"database": "orders"}
    emit(log, "after")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["inside database=orders n=1", "other thread", "after"]
    assert caplog.records[0].fields == {"database": "orders", "n": 1}  # type: ignore[attr-defined]


class LostControl:
    """A control session whose heartbeat finds the connection gone."""

    relay_id = "0" * 32
    broken = False
    backend = None

    def heartbeat(self) -> None:
        self.broken = True
        raise DatabaseUnavailable("server closed the connection")

    def close(self) -> None:
        pass


def test_liveness__the_heartbeat_thread_names_the_database_of_the_thread_that_started_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    with context(database="orders"):
        liveness = Liveness(LostControl(), interval=0.01)  # type: ignore[arg-type]
    liveness._thread.start()
    liveness._thread.join(5)
    [lost] = [r for r in caplog.records if "relay.control_session_lost" in r.getMessage()]
    assert lost.getMessage().startswith("relay.control_session_lost database=orders ")
