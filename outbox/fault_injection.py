"""Deterministic crash points for the fault-injection suite (tests only).

Set ``OUTBOX_CRASH_AT=<point>[:<n>]`` in a relay's environment and the relay
kills itself with SIGKILL the n-th time (default the first) it reaches that
point.  The points are the step boundaries of ``batches.py``; when the variable is
unset, ``reached`` is one dictionary lookup.  Pipelined, the n-th occurrence
counts across batches: ``after_prepare:2`` is batch 2's PREPARE, with batch 1 still
in flight.

A point only observes the relay: armed or not, the relay runs the production
schedule (no confirm is awaited that production would not await), so what a crash
leaves on the broker depends on how far the broker got, as after a real kill -9.
The crash tests learn that from the evidence (the ledger, the queue) and assert
the crash table's bounds (``outbox/relay/batches.py``).
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
