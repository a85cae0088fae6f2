"""A cumulative histogram of durations, as plain data (no metrics library).

The relay observes one value per committed batch; ``outbox.relay.metrics`` turns a
``snapshot`` into a Prometheus histogram when scraped.  A lock keeps a snapshot
consistent (count equals the last bucket) while the relay thread observes.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading

# Seconds.  A 1000-row batch takes tens of milliseconds on a healthy pair of servers;
# the top buckets catch publish timeouts and blocked connections.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    buckets: tuple[tuple[float, int], ...]  # (upper bound, cumulative count), +inf last
    count: int
    total: float


class Durations:
    def __init__(self, bounds: tuple[float, ...] = BUCKETS) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError("bucket bounds must be increasing")
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last one is +inf
        self._total = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        index = bisect.bisect_left(self._bounds, seconds)
        with self._lock:
            self._counts[index] += 1
            self._total += seconds

    def snapshot(self) -> Snapshot:
        with self._lock:
            counts, total = list(self._counts), self._total
        cumulative, running = [], 0
        for bound, count in zip((*self._bounds, float("inf")), counts, strict=True):
            running += count
            cumulative.append((bound, running))
        return Snapshot(tuple(cumulative), running, total)
