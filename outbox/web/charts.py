"""The overview's charts, as plain data: samples in, one value per minute out, and the
shapes of an inline SVG (drawn by ``templates/_charts.html``, no script).

A sample is what the console read at one moment: levels (the backlog, its oldest
row's age, messages parked now) and counters that only grow (rows ever published,
dead-lettered, applied, parked).  A level's minute is its last sample in that
minute; a counter's minute is the sum of its increases between samples that end in
that minute (a counter that went down was reset, e.g. by a server restart: that
step counts nothing).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

MINUTES = 60
WIDTH, HEIGHT = 360.0, 80.0  # the plot area of one chart, in SVG units


@dataclasses.dataclass(frozen=True)
class Sample:
    at: float  # seconds since the epoch
    values: Mapping[str, float]


@dataclasses.dataclass(frozen=True)
class Bar:
    minute: int  # minutes before now (0: the current one)
    value: float
    x: float
    y: float
    width: float
    height: float


@dataclasses.dataclass(frozen=True)
class Chart:
    """One series over the last hour, a value (or None: no sample) per minute."""

    key: str  # the field charted, e.g. "backlog" (a CSS class and test hook)
    title: str
    unit: str
    kind: str  # "level" or "rate" (per minute)
    minutes: tuple[float | None, ...]  # oldest first; the last is the current minute

    @property
    def latest(self) -> float | None:
        return next((v for v in reversed(self.minutes) if v is not None), None)

    @property
    def total(self) -> float:
        """A rate's sum over the hour."""
        return sum(v for v in self.minutes if v is not None)

    @property
    def peak(self) -> float:
        return max((v for v in self.minutes if v is not None), default=0.0)

    @property
    def scale(self) -> float:
        """The top of the plot: the peak rounded up to 1, 2 or 5 times a power of ten."""
        peak = self.peak
        if peak <= 0:
            return 1.0
        power = 10.0 ** math.floor(math.log10(peak))
        return next(float(m * power) for m in (1, 2, 5, 10) if m * power >= peak)

    @property
    def bars(self) -> list[Bar]:
        step = WIDTH / len(self.minutes)
        found = []
        for i, value in enumerate(self.minutes):
            if value is None:
                continue
            height = HEIGHT * value / self.scale
            found.append(
                Bar(len(self.minutes) - 1 - i, value, i * step, HEIGHT - height, step * 0.8, height)
            )
        return found

    @property
    def line(self) -> str:
        """A level's polyline: ``x,y`` of each minute with a sample."""
        step = WIDTH / len(self.minutes)
        return " ".join(
            f"{i * step + step / 2:.1f},{HEIGHT - HEIGHT * v / self.scale:.1f}"
            for i, v in enumerate(self.minutes)
            if v is not None
        )


def per_minute(
    samples: Sequence[Sample], field: str, kind: str, now: float, minutes: int = MINUTES
) -> tuple[float | None, ...]:
    """``field`` over the ``minutes`` minutes up to ``now`` (oldest first)."""
    current = math.floor(now / 60)
    first = current - minutes + 1
    values: list[float | None] = [None] * minutes
    previous: Sample | None = None
    for sample in samples:
        slot = math.floor(sample.at / 60) - first
        value = sample.values.get(field)
        if kind == "level":
            if 0 <= slot < minutes and value is not None:
                values[slot] = float(value)
        elif previous is not None and value is not None:
            before = previous.values.get(field)
            if 0 <= slot < minutes and before is not None:
                step = float(value) - float(before)
                values[slot] = (values[slot] or 0.0) + (step if step > 0 else 0.0)
        elif 0 <= slot < minutes:
            values[slot] = values[slot] or 0.0
        previous = sample
    return tuple(values)


# What each kind of table's charts show: (field, title, unit, kind).
OUTBOX_CHARTS = (
    ("backlog", "Backlog", "rows", "level"),
    ("oldest_seconds", "Oldest row", "s", "level"),
    ("published", "Published", "per minute", "rate"),
    ("dead_lettered", "Dead-lettered", "per minute", "rate"),
    ("dead_rows", "Dead rows", "rows", "level"),
    ("horizon_seconds", "MVCC horizon age", "s", "level"),
)
INBOX_CHARTS = (
    ("applied", "Applied", "per minute", "rate"),
    ("parked", "Parked", "per minute", "rate"),
)


def charts(
    samples: Sequence[Sample], specs: Sequence[tuple[str, str, str, str]], now: float
) -> list[Chart]:
    return [
        Chart(field, title, unit, kind, per_minute(samples, field, kind, now))
        for field, title, unit, kind in specs
    ]
