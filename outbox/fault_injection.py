"""Deterministic crash points for the fault-injection suite (tests only).

The test suite (its pytest plugin ``tests/fixtures/faults.py``) sets
``OUTBOX_FAULT_INJECTION=kill-this-process-on-purpose`` for every process it starts;
with that switch, ``OUTBOX_CRASH_AT=<point>[:<n>]`` in a relay's or consumer's
environment makes it kill itself with SIGKILL the n-th time (default the first) it
reaches that point.  Without the switch, exactly as written, ``OUTBOX_CRASH_AT`` is
ignored: an installed relay that inherits it by mistake (a copied environment file,
a test variable left in a deployment) never crashes on purpose.  The points are the
step boundaries of ``outbox/relay/batches.py`` and ``outbox/inbox/process.py``; when
nothing is armed, ``reached`` is one string comparison.  Pipelined, the n-th
occurrence counts across batches: ``after_prepare:2`` is batch 2's PREPARE, with
batch 1 still in flight.  In a fleet (``outbox.fleet``), ``OUTBOX_CRASH_DATABASE=<name>``
makes only that target's threads count and reach the point (the others' batches
are whatever they were when the process dies).

A point only observes the relay: armed or not, the relay runs the production
schedule (no confirm is awaited that production would not await), so what a crash
leaves on the broker depends on how far the broker got, as after a real kill -9.
The crash tests learn that from the evidence (the ledger, the queue) and assert
the crash table's bounds (``outbox/relay/batches.py``).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping

from outbox import events

POINTS = (
    "after_claim",
    "after_prepare",
    "mid_publish",
    "after_publish",
    "after_ledger",
    "before_commit_prepared",
    # the relay's mover (outbox/relay/process.py): due scheduled rows moved into the
    # outbox, not claimed yet.
    "after_move",
    # outbox consume (outbox/inbox/process.py): a message's effect committed, its ack
    # not sent yet.
    "consume_after_commit",
)

# The test suite's switch.  A variable and a sentence, both exact: an empty or "1"
# value, or a variable of a similar name, arms nothing.
SWITCH = "OUTBOX_FAULT_INJECTION"
SWITCH_ON = "kill-this-process-on-purpose"


def armed_from(environ: Mapping[str, str]) -> tuple[str, int]:
    """The point and occurrence ``environ`` arms: ``("", 0)`` unless the test suite's
    switch is on and ``OUTBOX_CRASH_AT`` is set; an unknown point is refused only
    then (a production process does not read the variable at all)."""
    spec = environ.get("OUTBOX_CRASH_AT", "")
    if environ.get(SWITCH) != SWITCH_ON or not spec:
        return "", 0
    point, _, nth = spec.partition(":")
    if point not in POINTS:
        raise SystemExit(f"OUTBOX_CRASH_AT: unknown point {point!r}; one of {', '.join(POINTS)}")
    return point, int(nth or 1)


_point, _remaining = armed_from(os.environ)
# A fleet's target whose threads reach the point ("": any thread).
_database = os.environ.get("OUTBOX_CRASH_DATABASE", "") if _point else ""


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


# What an armed point does when reached; the unit tests of the batch loop replace it
# with an exception, to look at what the "crash" left behind in memory.
crash = _kill


def arm(point: str, nth: int = 1) -> None:
    """Arm ``point`` for its ``nth`` occurrence (what OUTBOX_CRASH_AT does at import,
    with the test suite's switch on); for tests that run the loop in their process."""
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
    if _database and events.current_context().get("database") != _database:
        return
    _remaining -= 1
    if _remaining == 0:
        crash()
