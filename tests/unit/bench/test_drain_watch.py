"""How often the bench looks at the queue while relays drain it (``watch_pause``):
rarely while the end is far, every 5 ms once it is near."""

from __future__ import annotations

import pytest

from outbox.bench.harness import WATCH_MAX_SECONDS, WATCH_MIN_SECONDS, watch_pause


def test_watch_pause__often_before_the_first_message_and_near_the_end() -> None:
    assert watch_pause(0, 80_000, 0.5) == WATCH_MIN_SECONDS
    assert watch_pause(100, 80_000, 0.0) == WATCH_MIN_SECONDS
    # 10,000 msg/s: 5 ms left, a quarter of it is below the floor.
    assert watch_pause(79_950, 80_000, 7.995) == WATCH_MIN_SECONDS


def test_watch_pause__a_quarter_of_the_rest_at_the_rate_so_far_at_most_the_ceiling() -> None:
    # 10,000 msg/s, 200 ms left: look again in 50 ms.
    assert watch_pause(78_000, 80_000, 7.8) == pytest.approx(0.05)
    # 8 s left: the ceiling.
    assert watch_pause(1_000, 80_000, 0.1) == WATCH_MAX_SECONDS


def test_watch_pause__overshoots_the_end_by_at_most_the_floor_at_a_steady_rate() -> None:
    rate, rows, now, looks = 7_000.0, 80_000, 0.0, 0
    while (delivered := min(rows, int(now * rate))) < rows:
        now += watch_pause(delivered, rows, now)
        looks += 1
    assert now - rows / rate <= WATCH_MIN_SECONDS + 1e-9
    assert looks < 200  # every 5 ms: 2,286
