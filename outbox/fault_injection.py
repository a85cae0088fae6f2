"""Deterministic crash points for the fault-injection suite (tests only).

Set ``OUTBOX_CRASH_AT=<point>[:<n>]`` in a relay's environment and the relay
kills itself with SIGKILL the n-th time (default the first) it reaches that
point.  The points are the step boundaries of ``batches.py``; when the variable is
unset, ``reached`` is one dictionary lookup.  Pipelined, the n-th occurrence
counts across batches: ``after_prepare:2`` is batch 2's PREPARE while batch 1
awaits its confirms.  Before an armed crash the relay lets the broker confirm
whatever is in flight, so each crash leaves an exact number of duplicates.
"""

from __future__ import annotations

import os
import signal

POINTS = (
    "after_claim",
    "after_prepare",
    "mid_publish",
    "after_publish",
    "after_ledger",
    "before_commit_prepared",
    # outbox consume (inbox.py): a message's effect committed, its ack not sent yet.
    "consume_after_commit",
)

_spec = os.environ.get("OUTBOX_CRASH_AT", "")
_point, _, _nth = _spec.partition(":")
_remaining = int(_nth or 1) if _point else 0
if _point and _point not in POINTS:
    raise SystemExit(f"OUTBOX_CRASH_AT: unknown point {_point!r}; one of {', '.join(POINTS)}")


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


# What an armed point does when reached; the unit tests of the batch loop replace it
# with an exception, to look at what the "crash" left behind in memory.
crash = _kill


def arm(point: str, nth: int = 1) -> None:
    """Arm ``point`` for its ``nth`` occurrence (what OUTBOX_CRASH_AT does at import)."""
    global _point, _remaining
    if point not in POINTS:
        raise ValueError(f"unknown crash point {point!r}")
    _point, _remaining = point, nth


def disarm() -> None:
    global _point, _remaining
    _point, _remaining = "", 0


def reached(point: str) -> None:
    global _remaining
    if point != _point:
        return
    _remaining -= 1
    if _remaining == 0:
        crash()


def active() -> bool:
    """True while a crash point is armed: the relay then lets the broker confirm what
    is in flight before it picks the step's order (``Batches._confirms_in``), so that
    the outcome of each crash does not depend on how fast the broker was."""
    return bool(_point) and _remaining > 0


def armed(point: str) -> bool:
    """True if the next ``reached(point)`` will crash (lets the relay split a publish)."""
    return point == _point and _remaining == 1
