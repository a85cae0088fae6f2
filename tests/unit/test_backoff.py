import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox import backoff


@given(st.integers(min_value=0, max_value=1000), st.floats(0.01, 5), st.floats(5, 120))
def test_backoff__stays_within_half_and_full_ceiling(
    attempt: int, initial: float, maximum: float
) -> None:
    ceiling = min(maximum, initial * 2 ** min(attempt, 30))
    value = backoff.delay(attempt, initial=initial, maximum=maximum, rng=random.Random(attempt))
    assert ceiling / 2 <= value <= ceiling


def test_backoff__grows_then_caps() -> None:
    rng = random.Random(1)
    delays = [backoff.delay(a, initial=0.2, maximum=30, rng=rng) for a in range(20)]
    assert delays[0] <= 0.2
    assert min(delays[10:]) >= 15  # never a tight loop once an outage lasts
    assert max(delays) <= 30


def test_backoff__rejects_negative_attempts() -> None:
    with pytest.raises(ValueError):
        backoff.delay(-1, initial=1, maximum=2)
