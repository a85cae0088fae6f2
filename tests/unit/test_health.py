from __future__ import annotations

import dataclasses
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox import health
from outbox.config import Settings
from outbox.durations import Durations


def ready(**overrides: object) -> health.Check:
    values: dict[str, object] = {
        "started": True,
        "stopping": False,
        "broker_connected": True,
        "last_error": None,
        "database_error": None,
    }
    values.update(overrides)
    return health.readiness(**values)  # type: ignore[arg-type]


def test_readiness__ready_when_started_connected_and_last_pass_ok() -> None:
    assert ready() == health.Check(True)
    assert ready().body() == "ok\n"


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({"started": False}, "not connected yet"),
        ({"stopping": True}, "stopping"),
        ({"broker_connected": False}, "broker: not connected"),
        ({"database_error": "connection refused"}, "database: connection refused"),
        ({"last_error": "nacked"}, "last pass failed: nacked"),
    ],
)
def test_readiness__each_cause_makes_it_not_ready_and_says_why(
    overrides: dict[str, object], problem: str
) -> None:
    check = ready(**overrides)
    assert not check.ok
    assert problem in check.body()


def test_liveness__limit_covers_the_slowest_healthy_pass() -> None:
    settings = Settings()
    limit = health.liveness_limit(settings)
    slowest_pass = (
        2 * settings.publish_timeout + settings.backoff_max + 3 * settings.connect_timeout
    )
    assert limit > slowest_pass
    slower = dataclasses.replace(settings, publish_timeout=settings.publish_timeout * 4)
    assert health.liveness_limit(slower) > limit


@given(st.floats(min_value=0, max_value=1e6), st.floats(min_value=1, max_value=1e6))
def test_liveness__fails_exactly_past_the_limit(since: float, limit: float) -> None:
    assert health.liveness(seconds_since_progress=since, limit=limit).ok == (since <= limit)


@given(st.lists(st.floats(min_value=0, max_value=1000, allow_nan=False), max_size=200))
def test_durations__cumulative_buckets_count_and_sum(values: list[float]) -> None:
    durations = Durations()
    for value in values:
        durations.observe(value)
    snapshot = durations.snapshot()
    assert snapshot.count == len(values)
    assert snapshot.total == pytest.approx(sum(values))
    assert snapshot.buckets[-1] == (float("inf"), len(values))
    for bound, count in snapshot.buckets:
        assert count == sum(1 for v in values if v <= bound)


def test_durations__snapshot_consistent_while_observed_from_another_thread() -> None:
    durations = Durations()
    done = threading.Event()

    def observe() -> None:
        while not done.is_set():
            durations.observe(0.02)

    thread = threading.Thread(target=observe)
    thread.start()
    try:
        for _ in range(200):
            snapshot = durations.snapshot()
            assert snapshot.buckets[-1][1] == snapshot.count
    finally:
        done.set()
        thread.join()


def test_durations__bounds_must_increase() -> None:
    with pytest.raises(ValueError, match="increasing"):
        Durations((1.0, 0.5))
