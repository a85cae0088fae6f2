"""When the relay moves scheduled rows into the outbox (schema 0009).

LISTEN/NOTIFY wakes a relay on a commit, never at a time: the relay learns the next
due time from each move (``outbox.db.scheduled``) and moves again when it comes,
sleeping until then when idle.  A NOTIFY (an application's commit, which may have
scheduled a row due earlier than the one known) makes it move at once, and so does
each idle poll (a commit that notified nobody); while busy, when it does not listen,
it moves at least every ``BUSY_RECHECK`` seconds.  A sweep (a move that scans every
due row) runs every ``scheduled.SWEEP_INTERVAL``.

Times here are ``time.monotonic``; a due time is turned into one by the server's
own clock at the move, so the relay's clock plays no part.  A step of the database
host's clock moves every due time with it: forward, rows become due sooner (moved
at the next move: the next known due time, a NOTIFY or a poll); back, later (the
relay wakes at the time it computed, moves nothing, and learns the new one).

Crash: nothing here is durable; a new relay moves from the bottom (a sweep) at once.
"""

from __future__ import annotations

import dataclasses
import datetime

from outbox.db.scheduled import SWEEP_INTERVAL, Moved

# While busy (not listening), how often the relay moves anyway (seconds).
BUSY_RECHECK = 1.0
# After a move that failed, the next one (seconds).
MOVE_RETRY = 5.0


def due_in(moved: Moved) -> float | None:
    """Seconds from the move until the next row is due (None: nothing scheduled)."""
    if moved.next_due is None:
        return None
    return max(0.0, (moved.next_due - moved.now) / datetime.timedelta(seconds=1))


@dataclasses.dataclass
class MoveSchedule:
    """The relay's plan for its next moves."""

    covered: datetime.datetime | None = None  # ``Moved.covered`` of the last move
    next_due_at: float | None = None  # when the next known row is due (None: none known)
    next_move: float = 0.0  # when the busy loop moves next
    next_sweep: float = 0.0

    def sweep_now(self, now: float) -> bool:
        return now >= self.next_sweep

    def moved(self, result: Moved, now: float, *, swept: bool, full: bool) -> None:
        """Plan after a move at ``now`` (``full``: it moved as many as it may)."""
        self.covered = result.covered
        if swept:
            self.next_sweep = now + SWEEP_INTERVAL
        wait = due_in(result)
        self.next_due_at = None if wait is None else now + wait
        if full:
            self.next_move = now
        else:
            self.next_move = min(now + BUSY_RECHECK, self.idle_until(now))

    def failed(self, now: float) -> None:
        """A move failed (a lock held on the outbox, an error): try again after
        ``MOVE_RETRY`` seconds, not at every step of the loop."""
        self.next_move = now + MOVE_RETRY

    def woken(self) -> None:
        """A NOTIFY or a poll: a row due earlier than the known one may be committed."""
        self.next_move = 0.0

    def idle_until(self, now: float) -> float:
        """When an idle relay must move next, whatever wakes it before."""
        return min(
            self.next_sweep,
            self.next_due_at if self.next_due_at is not None else now + SWEEP_INTERVAL,
        )
