"""The long-running commands freeze their start-up heap (``freeze_startup_heap``)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from outbox import cli
from outbox.cli import common
from outbox.relay import process


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_freeze_startup_heap__puts_what_lives_now_out_of_the_collectors_reach(
    unfrozen: None,
) -> None:
    gc.collect()  # what the test process left as garbage is not "alive"
    alive = len(gc.get_objects())
    common.freeze_startup_heap()
    assert gc.get_freeze_count() >= alive - 1_000
    young = [[i] for i in range(100)]  # created later: collected as usual
    assert len(gc.get_objects()) < len(young) + 1_000


def test_relay_command__freezes_after_connecting_and_before_relaying(
    monkeypatch: pytest.MonkeyPatch, unfrozen: None
) -> None:
    calls: list[str] = []

    class FakeRelay:
        def __init__(self, *_: Any, **__: Any) -> None:
            pass

        def start(self) -> None:
            calls.append("start")

        def run(self, *, drain: bool) -> process.Stats:
            calls.append("run")
            return process.Stats()

    monkeypatch.setattr(process, "Relay", FakeRelay)
    monkeypatch.setattr("outbox.cli.relay.freeze_startup_heap", lambda: calls.append("freeze"))
    monkeypatch.setattr(
        "outbox.cli.relay.collect_young_less_often", lambda size: calls.append(f"young {size}")
    )
    with pytest.raises(SystemExit) as exited:
        cli.main(
            ["relay", "--drain", "--dsn", "postgresql://127.0.0.1:1/none", "--batch-size", "7"]
        )
    assert exited.value.code in (0, None)
    assert calls == ["start", "freeze", "young 7", "run"]


@pytest.fixture
def thresholds() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_collect_young_less_often__scales_with_the_batch_and_never_lowers(
    thresholds: None,
) -> None:
    gc.set_threshold(700, 10, 10)
    common.collect_young_less_often(1000)
    assert gc.get_threshold() == (common.OBJECTS_PER_ROW * 1000, 10, 10)
    common.collect_young_less_often(1)
    assert gc.get_threshold() == (common.OBJECTS_PER_ROW * 1000, 10, 10)
