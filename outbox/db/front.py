"""Where a relay's claims start (``ClaimFront``): past the rows known to be gone.

Why.  Every row the relay commits leaves a dead tuple and a dead index entry that
only vacuum removes, and vacuum cannot while anything holds the MVCC horizon back
(a REPEATABLE READ report, ``pg_dump``, a session idle in transaction, a
replication slot, a prepared transaction).  A claim that starts at the lowest id
walks every row deleted since then, on every claim: measured 7.7 → 42.5 ms p50
after 4 minutes at 1,000 rows/s, and ``python -m outbox.bench.deadrows`` shows
the claim's cost linear in the dead rows
(docs/explanation/how-it-works.md#claims-and-dead-rows).

The state, kept per work session by ``BatchStore`` (``front``), returned by each
claim and handed to the next (``queries.sql``, ``claim_batch``):

- ``low_water`` (W): the smallest id *visible* to the previous claim's snapshot
  among the ids ≥ the W before it (plain MVCC, no SKIP LOCKED: rows being
  claimed, rows held by any relay's batch, prepared or not, are all visible).
  The claim's scans start at W.  ``None``: from the bottom (a new session
  without a usable saved front).
- ``late``: ids below W that became visible after W passed them, found by the
  sweep below and kept until a claim sees them gone (deleted by a committed
  batch); the claim takes them by id.  At most ``LATE_MOST``: a bulk load that
  committed late moves W back to its first row instead (lowering W is always
  safe), and the claims then take that stretch in id order, walking it once.
- ``seen``: the previous claim's snapshot (``pg_current_snapshot()`` as text).

Invariant, after each claim with snapshot S: every row with id < W that still
exists is in ``late``, or was inserted by a transaction S does not see (its
``txid`` is in ``pg_snapshot_xip(S)`` or ≥ ``pg_snapshot_xmax(S)``).  So the next
claim finds every row below W that became visible since, by its ``txid`` (the
inserting transaction, column of schema 0006, a btree index): point lookups for
the transactions S saw in progress and a range from ``xmax(S)``, which holds only
the rows inserted since S.  Ids and transaction ids are not ordered together
(``nextval`` runs before the transaction has an xid, a sequence with CACHE > 1
hands each session a block, an application may insert with OVERRIDING SYSTEM
VALUE, ``outbox dead-letters retry`` does): a row that took its id early and
committed late is found by its transaction, whatever its id.

Why W never passes a row that could still be claimed:
- a row claimed by a batch that is later rolled back (ROLLBACK PREPARED by its
  relay or a resolver, a claim session killed before PREPARE) was visible all
  along: a delete counts only once committed.  W stays at or below it;
- a row skipped because another relay held it is visible too;
- a row whose insert had not committed is found by its txid (above);
- a row gone (its delete committed) never comes back; a dead letter retried is
  a new insert, with a new txid.

Per-key order holds: a key's rows that exist and are visible are all in ``late``
or at ≥ W, so the claim's ``keyed`` window (the late rows, then the front from
W) sees a key's first row exactly as a walk from the bottom would.

The cost of a claim is then the rows deleted since the previous claim's W (a
batch or two per relay in flight), not since the horizon was taken.  A batch
prepared by a dead relay, until a resolver finishes it, holds every W at or below
its first row (its rows are visible), as it holds the horizon.

A new session (schema 0007; the relay's start, every reconnect) starts from a
saved front rather than from the bottom, which cost 5-7 s at 5 million dead rows.
A front stays valid once computed: time only adds rows below W whose inserting
transaction S did not see (a transaction that starts later has a txid ≥ xmax(S));
deletes only shrink the set of rows below W; a batch rolled back puts back rows
that were visible to S all along (so at or after W, or in ``late``); a dead letter
retried is a new insert with a new txid.  So any saved front is a valid start,
however old: the first claim's sweep (from xmax(S), and the transactions S saw in
progress that have ended) finds what committed since.  Its cost is the rows
inserted since S (one txid index entry each, dead or not): a front saved every
``SAVE_SECONDS`` makes that a few seconds' worth, plus what the application wrote
while no relay ran (rows the relays must read anyway).  Rows written before schema
0006 (``txid`` NULL) are covered too: the front saved was computed by a chain of
claims that began at the bottom, after every such row had committed.

The relays save their front outside the claim (the claim is prepared: a row lock
held until COMMIT PREPARED would serialise the relays), at most every
``SAVE_SECONDS`` and on a clean stop, into one row per outbox table that a staler
front never replaces (``queries.sql``, ``save_front``): behind a held horizon every
UPDATE of it leaves a dead version, a few hundred an hour, read once per session.

What a saved front relies on is in the WAL before the row that saves it: the
deletes of the rows below W committed before the claim's snapshot, and the saving
transaction has a txid ≥ xmax(S).  A physical standby promoted after a failover,
or a point-in-time recovery, replays a prefix of the WAL: if it has the front, it
has all of that, and its next txid is above xmax(S), so no txid S judged will be
handed out again (ids may be: a new txid finds them).  What breaks it is a logical
copy: a dump restored elsewhere or in another database of this cluster (its rows
keep the txids of the first, as data), ``pg_upgrade`` or ``pg_resetwal`` (txids and
the saved row no longer from one history), an outbox truncated and reloaded from a
copy.  So a new session uses the saved front only if it was saved on this cluster
(``pg_control_system().system_identifier``) and timeline
(``pg_control_checkpoint().timeline_id``; stricter than needed: after a failover the
first session walks from the bottom once, as does one that reads the timeline
before the promotion's checkpoint records the new one), for this file of the
outbox table (``pg_relation_filenode``: a table restored, truncated or rewritten by
``VACUUM FULL`` has a new one; a walk from the bottom once), and its xmax(S) is not
beyond this server's (``resumed``).  Otherwise it starts from the bottom.  A session
saves its front only for the file its claims began on (``queries.sql``,
``save_front``): one that finds the file changed at a save (the outbox rewritten
while it ran) starts again from the bottom itself, rather than vouch for the new
file with a front computed on the old one.

Stamped txids (schema 0008).  A trigger sets ``txid`` to the writing transaction on
every INSERT and UPDATE, whatever the statement wrote (a reload from a backup of the
outbox with ``INSERT … SELECT *``, explicit values, ``COPY``; ENABLE ALWAYS, so in a
logical replication apply worker too).  So a row that appears below W, whatever put
it there, is found by the sweep of the first claim after its commit, and goes
through the keyed window as a late row, ahead of the later rows of its key: per-key
order holds for reloaded rows without any look per key (which would walk each key's
dead index entries behind a held horizon).

The safety net.  A row below W whose ``txid`` is not its inserting transaction's
(written with the outbox's triggers off, ``pg_restore --disable-triggers``, or before
schema 0008) is invisible to the sweep.  Until schema 0007 the claims of a
session started from the bottom again every ``RESCAN_SECONDS``: one claim walked
every dead row (what a new session's first claim cost), a latency spike every 10
minutes per relay behind a held horizon.  Now a pass reads the outbox in slices,
one claim carrying one slice (``RescanPass``; ``BatchStore.rescan_due``): a slice
is a range of heap pages read by a TID range scan, which reads those pages and
nothing else, dead rows included, and records every row below W that it sees
(visible to the claim's snapshot) as late.  That keeps the invariant (``late`` may
hold any ids below W that exist; the claim drops those gone), and per-key order:
such a row goes through the keyed window as the late rows do, and a key's later
rows wait behind it.  A slice of pages, not of ids: a range of ids [a, b) walks the
primary key's entries from a, dead ones included, but where the pass begins (the
lowest id, dead or alive) is only found by that very walk, and ids may be far apart
(``OVERRIDING SYSTEM VALUE``).  Pages are bounded: the pass covers [0, size of the
heap when it began) in at most ``RESCAN_SLICES`` slices of at least
``SLICE_PAGES_MIN`` pages, a slice a second, so a row written after the pass began
on a page beyond that, or moved by an UPDATE across the slice being read, waits for
the next pass.

Its schedule is the table's (schema 0008, ``NetState``): the pass under way and the
last whole pass are saved in the front's row.  A session follows it (read when it
resumes and at each save): it begins a pass when none is under way and the last began
``RESCAN_SECONDS`` ago (``begun``, under the row's lock: one relay begins it), reads
the pass's next slice, and saves what the slice found (its late ids) with the front
and the pass's progress in one transaction before its next claim (``recorded``): a
slice counts only once its finds are saved, whichever relay saves the fresher front
(late ids of both are kept).  Restarts, reconnects and relays side by side carry one
pass on; two relays may read a slice twice, never skip one.  Bound: a row written at
t is found by the first pass that begins after t, so within ``RESCAN_SECONDS`` and a
pass (at most half of it), 15 minutes by default, plus time when no relay runs.

Counting.  ``outbox status``, the metrics and the console's charts count the backlog
where the claims look, from the saved front (``queries.sql``, ``front_rows``, composed
into ``backlog``, ``metrics_snapshot`` and ``chart_sample``): the rows from W by the
primary key (the backlog, and the dead rows since the front was saved), the late ids,
and the rows inserted by transactions its snapshot did not see.  By the invariant that is
every row that exists, but a row whose txid the application wrote, below W, until
the safety net finds it (it is then a late id of a saved front).  Not an estimate:
exact, to that exception, which ``outbox status`` states beside the count (when the
last whole pass began, the rows it found; ``--exact`` counts every row).

Where it comes from: the sweep is how PgQ (Skype's skytools, ``pgq.batch_event_sql``)
selects a batch's events between two tick snapshots: a range of txids from the
earlier snapshot's xmax, and the transactions it saw in progress that committed
since as an IN list, so a long transaction does not widen the range.  Here the
"batch" is everything committed since the relay's previous claim, and the
low-water mark replaces PgQ's rotating tables: no tick, so no tick's latency.
Que and River select from a job table by an index and rely on (auto)vacuum
(River issue #59, "Autovacuum Starvation"; Que's docs advise a manual VACUUM every
few minutes), which a held horizon defeats.

Design B, measured beside it (``python -m outbox.bench.deadrows``): the same W without a
txid, and a full walk from the bottom every N seconds to catch late rows: each
such walk costs what every claim costs today, and a late row waits up to N
seconds (sliced as the safety net is, it would wait for a whole pass).  A
partitioned outbox (drained partitions detached and dropped) needs
ACCESS EXCLUSIVE or a ``DETACH … CONCURRENTLY`` that waits for every snapshot
that may see the partition, and ``pg_dump`` or a report holding ACCESS SHARE on
it postpones the drop for hours: not chosen.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from psycopg.types.numeric import Int8

# Below every id: "from the bottom" (a bigint).
BOTTOM = -(2**63)

# Most late ids kept: the claim looks each one up.  Beyond this (a bulk load that
# took its ids early and committed late), W moves back to the first late row
# instead, and the claims walk that stretch once, in id order, as they take it.
LATE_MOST = 1_000


# How often a pass of the safety net begins (``RescanPass``; ``--rescan-interval``
# sets it per relay), counted from when the last pass began, as saved with the front
# (``NetState``): whatever the restarts, reconnects and number of relays.  Not the
# way late rows are found: a row below W whose ``txid`` is not its inserting
# transaction's (only possible with the stamping trigger of schema 0008 switched off,
# or written before it) is invisible to the sweep, and without a pass would wait
# below W for good.  Such a row waits at most this long and a pass (up to half of
# it): 15 minutes by default, plus any time no relay runs.
RESCAN_SECONDS = 600.0

# A pass reads the outbox's heap in this many slices at most (more pages per slice
# on a larger table), a relay's claim carrying a slice every
# RESCAN_SECONDS / (2 * RESCAN_SLICES) (1 s): a pass takes at most 5 minutes.
RESCAN_SLICES = 300
# And at least this many pages per slice (1 MB of 8 kB pages).
SLICE_PAGES_MIN = 128

# How often a session saves its front (``BatchStore.save_front``; also on a clean
# stop), at most: each save is an UPDATE of the one row of ``<table>_claim_front``,
# which leaves a dead version behind a held horizon too (360 an hour per relay,
# read once by each new session), and a new session starting from a front this old
# sweeps the rows inserted since (by their txid: rows that exist, mostly).
SAVE_SECONDS = 10.0


@dataclasses.dataclass(frozen=True)
class ClaimFront:
    """Where the next claim starts (module docstring)."""

    low_water: int | None = None
    late: tuple[int, ...] = ()
    seen: str | None = None

    def params(self) -> dict[str, Any]:
        """The claim's (and the polls') parameters for this front.  Typed: the driver
        prepares the claim once per set of parameter types, and would otherwise
        send a small id as int2 or int4, a large one as int8."""
        return {
            "low_water": Int8(BOTTOM if self.low_water is None else self.low_water),
            "late": list(self.late),
            "seen": self.seen,
        }

    def after(self, low_water: int | None, late: list[int], seen: str) -> ClaimFront:
        """The front after a claim that returned these (``low_water`` None: the claim
        saw no row at or after W, which then stays).

        More than ``LATE_MOST`` late ids: W moves back to the first of them and none
        is kept (lowering W is always safe: fewer rows are then below it)."""
        mark = self.low_water if low_water is None else low_water
        if len(late) > LATE_MOST:
            first = min(late)
            return ClaimFront(first if mark is None else min(mark, first), (), seen)
        return ClaimFront(mark, tuple(late), seen)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where a front was computed, or where a session runs: the cluster
    (``pg_control_system().system_identifier``), its timeline
    (``pg_control_checkpoint().timeline_id``), the outbox table's file
    (``pg_relation_filenode``) and the next transaction id its snapshots would not
    see (``pg_snapshot_xmax(pg_current_snapshot())``)."""

    system_identifier: int
    timeline: int
    filenode: int
    xmax: int


@dataclasses.dataclass(frozen=True)
class SavedFront:
    """A front as saved in ``<table>_claim_front``, with where it was saved."""

    front: ClaimFront
    cluster: Cluster  # xmax: that of the front's own snapshot (``seen``)


def resumed(saved: SavedFront | None, here: Cluster) -> ClaimFront:
    """The front a new session starts from: the saved one if it was computed on this
    cluster and timeline, for this file of the outbox table, and its snapshot is not
    ahead of this server's, else from the bottom (module docstring, "A new
    session")."""
    if saved is None or saved.front.low_water is None or saved.front.seen is None:
        return ClaimFront()
    where = (saved.cluster.system_identifier, saved.cluster.timeline, saved.cluster.filenode)
    if where != (here.system_identifier, here.timeline, here.filenode):
        return ClaimFront()
    if saved.cluster.xmax > here.xmax:
        return ClaimFront()
    return saved.front


@dataclasses.dataclass(frozen=True)
class RescanPass:
    """One pass of the safety net over the pages [0, ``end``) of the outbox's heap
    (its size when the pass began), a slice per claim (module docstring, "The
    safety net"); ``at``: the first page of the next slice."""

    end: int
    at: int = 0

    def slice(self) -> tuple[int, int]:
        """The pages [first, last) of the next slice."""
        width = max(SLICE_PAGES_MIN, -(-self.end // RESCAN_SLICES))
        return self.at, min(self.end, self.at + width)

    def after(self) -> RescanPass | None:
        """The pass after its next slice was read (None: it is over)."""
        _, last = self.slice()
        return None if last >= self.end else RescanPass(self.end, last)


def tid(page: int) -> str:
    """The first tuple id of a page, as ``tid`` text."""
    return f"({page},0)"


@dataclasses.dataclass(frozen=True)
class NetState:
    """The safety net's schedule, as saved with the front in ``<table>_claim_front``
    (schema 0008; module docstring, "The safety net"): the pass under way (its end,
    the first page not yet read, when it began, the rows it found so far) and the
    last whole pass (when it began, the rows it found).  Times are PostgreSQL's,
    as text, and read back as ages (seconds before the read)."""

    pass_end: int | None = None
    pass_at: int = 0
    pass_began: str | None = None
    pass_found: int = 0
    pass_age: float | None = None
    last_pass_at: str | None = None
    last_pass_found: int | None = None
    last_pass_age: float | None = None

    def rescan(self) -> RescanPass | None:
        """The pass under way, from its next slice on."""
        return None if self.pass_end is None else RescanPass(self.pass_end, self.pass_at)


@dataclasses.dataclass(frozen=True)
class SliceRead:
    """A slice of a pass that a claim read: the pass (when it began), its pages
    [first, last) and the rows below W it found that their txid did not reveal."""

    pass_began: str
    first: int
    last: int
    found: int


def recorded(state: NetState, reads: tuple[SliceRead, ...]) -> NetState:
    """The schedule once these slice reads are saved with the front that holds what
    they found.  A read counts if it is the pass's next slice (another relay may
    have read it first: it then counts once); the last slice ends the pass."""
    for read in reads:
        if (
            state.pass_end is None
            or read.pass_began != state.pass_began
            or read.first != state.pass_at
        ):
            continue
        found = state.pass_found + read.found
        if read.last < state.pass_end:
            state = dataclasses.replace(state, pass_at=read.last, pass_found=found)
            continue
        state = NetState(
            last_pass_at=state.pass_began, last_pass_found=found, last_pass_age=state.pass_age
        )
    return state


def begun(state: NetState, interval: float, pages: int, now: str) -> NetState:
    """The schedule with a pass begun now over ``pages`` if none is under way and the
    last one began at least ``interval`` seconds ago (or never)."""
    if state.pass_end is not None:
        return state
    if state.last_pass_age is not None and state.last_pass_age < interval:
        return state
    return dataclasses.replace(
        state, pass_end=pages, pass_at=0, pass_began=now, pass_found=0, pass_age=0.0
    )


def next_pass_in(state: NetState, interval: float) -> float:
    """Seconds until a pass is due (0: one is under way, or due now)."""
    if state.pass_end is not None or state.last_pass_age is None:
        return 0.0
    return max(0.0, interval - state.last_pass_age)
