"""The relay's mover: scheduled rows (schema 0009) enter the outbox when due.

A row written with ``deliver_at`` in the future waits in ``<outbox>_scheduled``
(the outbox's BEFORE INSERT trigger puts it there), where no claim looks.  The
mover (``move_due`` in queries.sql) moves the due ones into the outbox, in due
order, in one short statement of its own on the relay's wake-up session (never
inside a batch: the outbox's wake-up trigger may NOTIFY in it).  From there the
claim, its front, ordering keys and 2PC handle them as any row just committed.

Crash table: the move is one statement, so a crash leaves the rows either in the
scheduled table (moved again by the next mover, any relay's) or in the outbox
(claimed as usual); never both, never neither.

Where the scan starts (``scan_from``, pure): moved rows leave dead index entries
at the low end of ``deliver_at``, which vacuum cannot remove while the MVCC horizon
is held; a scan from the bottom would read every one of them at every move.  The
mover remembers how far it got (``covered``: every row visible to it and due
before that was moved) and starts ``LOOK_BACK`` before it.  A row found only
later is one whose transaction committed after the mover passed its due time:
written before it was due (its ``deliver_at`` was in the future), it committed
more than ``LOOK_BACK`` late, or another relay's mover held it and rolled back.
Those are moved by the sweep, a scan from the bottom every ``SWEEP_INTERVAL``.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import psycopg

from outbox.db.queries import Queries

# How far before ``covered`` each move looks (rows committed that late after
# their due time are still moved at once), and how often a sweep looks at every
# due row (rows committed later than that: moved within this interval).
LOOK_BACK = datetime.timedelta(seconds=10)
SWEEP_INTERVAL = 60.0
# Rows moved per statement; a mover that moved this many moves again at once.
MOVE_LIMIT = 1000

_BOTTOM = datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)


@dataclasses.dataclass(frozen=True)
class Moved:
    """One move: how many rows entered the outbox, and when the next one is due."""

    rows: int
    covered: datetime.datetime  # every visible row due before it has been moved
    next_due: datetime.datetime | None  # the earliest row still waiting (None: none)
    now: datetime.datetime  # the server's clock at the move


def scan_from(covered: datetime.datetime | None, sweep: bool) -> datetime.datetime:
    """Where a move's index scan starts: ``LOOK_BACK`` before what is known moved,
    or the bottom for the first move of a session and for a sweep."""
    if covered is None or sweep:
        return _BOTTOM
    return covered - LOOK_BACK


def covered_after(
    rows: int, limit: int, last_due: datetime.datetime | None, now: datetime.datetime
) -> datetime.datetime:
    """How far a move got: up to its own now() if it moved fewer than ``limit``
    rows, else up to the last row it moved (more may be due behind it)."""
    if rows >= limit and last_due is not None:
        return last_due
    return now


def move_due(
    conn: psycopg.Connection[Any],
    queries: Queries,
    covered: datetime.datetime | None,
    *,
    sweep: bool,
    limit: int = MOVE_LIMIT,
) -> Moved:
    """Move the due rows into the outbox (one statement, autocommit)."""
    row = conn.execute(
        queries["move_due"], {"scan_from": scan_from(covered, sweep), "limit": limit}
    ).fetchone()
    assert row is not None
    return Moved(
        rows=row["moved"],
        covered=covered_after(row["moved"], limit, row["last_due"], row["now"]),
        next_due=row["next_due"],
        now=row["now"],
    )
