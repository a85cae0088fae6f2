"""The fleet's supervisor without servers: a target that fails or crashes is logged
and started again, the others go on; an unreadable targets file keeps the targets."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from outbox.config import Settings
from outbox.errors import DatabaseUnavailable
from outbox.fleet.process import DORMANT, RETRYING, SERVING, Fleet, TargetRelay
from outbox.fleet.targets import Target, TargetSource
from outbox.relay.process import Stats, StopFlag


class FakeRelay:
    """Fails ``Relay.start`` while its database is listed in ``failing``, raises a bug
    from ``run`` while listed in ``crashing``; else runs until stopped."""

    failing: dict[str, int] = {}
    crashing: dict[str, int] = {}
    started: list[str] = []

    def __init__(self, settings: Settings, stop: StopFlag) -> None:
        self.settings, self.stop = settings, stop
        self.stats = Stats()
        self.relay_id = "r"
        self.dormant = False
        self.name = settings.dsn.rsplit("/", 1)[-1]

    def start(self) -> None:
        if FakeRelay.failing.get(self.name, 0) > 0:
            FakeRelay.failing[self.name] -= 1
            raise DatabaseUnavailable("connection refused", "is the server up?")

    def run(self, *, drain: bool = False) -> Stats:
        FakeRelay.started.append(self.name)
        if FakeRelay.crashing.get(self.name, 0) > 0:
            FakeRelay.crashing[self.name] -= 1
            raise KeyError("a bug")
        while not self.stop:
            self.stop.wait(0.01)
            self.dormant = True
        return self.stats

    def close(self) -> None:
        pass


@pytest.fixture(autouse=True)
def fresh_fakes() -> None:
    FakeRelay.failing, FakeRelay.crashing, FakeRelay.started = {}, {}, []


def target(name: str) -> Target:
    return Target(name, f"postgresql://h/{name}")


def wait(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_target__a_start_that_fails_is_logged_with_hint_and_retried_with_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    FakeRelay.failing = {"a": 2}
    member = TargetRelay(
        target("a"), Settings(), retry_initial=0.05, retry_max=0.08, relay_factory=FakeRelay
    )
    member.start()
    wait(lambda: member.state == RETRYING)
    assert member.error == "connection refused"
    wait(lambda: member.state in (SERVING, DORMANT))
    member.stop.set()
    member.thread.join(5)
    failed = [r.getMessage() for r in caplog.records if "fleet.target_failed" in r.getMessage()]
    said = "fleet.target_failed database=a error=connection refused retry={} hint=is the server up?"
    assert failed == [said.format("0.05s"), said.format("0.08s")]


def test_target__an_unexpected_exception_is_logged_and_the_target_started_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    FakeRelay.crashing = {"a": 1}
    member = TargetRelay(target("a"), Settings(), retry_initial=0.01, relay_factory=FakeRelay)
    member.start()
    wait(lambda: FakeRelay.started == ["a", "a"])
    assert member.thread.is_alive()
    member.stop.set()
    member.thread.join(5)
    [crash] = [r.getMessage() for r in caplog.records if "fleet.target_crashed" in r.getMessage()]
    assert "database=a error=KeyError('a bug')" in crash and "Traceback" in crash


def test_fleet__targets_come_and_go_and_an_unreadable_file_keeps_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    path = tmp_path / "targets"
    path.write_text("postgresql://h/a\npostgresql://h/b\n")
    source = TargetSource(file=str(path), interval=0.01)
    FakeRelay.failing = {"b": 1000}  # b never starts: a is served all the same
    fleet = Fleet(source, Settings(), retry_initial=0.01, relay_factory=FakeRelay)
    runner = threading.Thread(target=fleet.run)
    runner.start()
    try:
        wait(lambda: [t.name for t in fleet.members()] == ["a", "b"])
        wait(lambda: fleet.members()[0].state in (SERVING, DORMANT))
        assert fleet.members()[1].state != SERVING
        path.write_text("postgresql://h/a\npostgresql://h/c\n")
        os.utime(path, (time.time() + 5, time.time() + 5))
        wait(lambda: [t.name for t in fleet.members()] == ["a", "c"])
        path.unlink()
        wait(lambda: "fleet.targets_unreadable" in caplog.text)
        assert [t.name for t in fleet.members()] == ["a", "c"]
    finally:
        fleet.stop.set()
        runner.join(10)
    assert not runner.is_alive() and not fleet.targets


def test_cli__the_fleets_default_dormancy_is_the_fleets() -> None:
    """The command does not import the fleet to know its default (``outbox.cli.relay``)."""
    from outbox.cli.relay import DORMANT_AFTER as command_default
    from outbox.fleet.process import DORMANT_AFTER

    assert command_default == DORMANT_AFTER


def test_fleet__a_targets_file_unreadable_at_start_is_a_usage_error(tmp_path: Path) -> None:
    from outbox.errors import InvalidSetting

    fleet = Fleet(TargetSource(file=str(tmp_path / "missing")), Settings())
    with pytest.raises(InvalidSetting) as raised:
        fleet.start()
    assert "cannot read the targets file" in raised.value.message
    assert raised.value.hint is not None and "readable" in raised.value.hint
