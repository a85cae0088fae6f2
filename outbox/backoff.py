"""Reconnect and retry delays (pure)."""

from __future__ import annotations

import random


def delay(
    attempt: int, *, initial: float, maximum: float, rng: random.Random | None = None
) -> float:
    """Exponential backoff with "equal jitter": in [d/2, d], d = min(max, initial·2^attempt).

    Half the delay is fixed so a flapping server is never hammered, half is random
    so many relays restarting together spread out.
    """
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    ceiling = min(maximum, initial * (2 ** min(attempt, 30)))
    jitter = rng.random() if rng is not None else random.random()
    return float(ceiling / 2 + jitter * ceiling / 2)
