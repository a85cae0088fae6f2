"""The saved claim front (schema 0007, ``outbox.db.front``, "A new session"): a
relay's new session (its start, every reconnect) starts where the claims before it
got, not from the lowest id, and still finds every row.

Costs are blocks read (``pg_statio_user_tables``), as in ``test_claim_front``.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from outbox.db.batches import BatchStore
from outbox.db.front import ClaimFront
from tests.integration.db.test_claim_front import (
    BATCH,
    _commit,
    _dead_rows,
    _insert,
    blocks_read,
    claim_cost,
    held_horizon,  # noqa: F401 - a fixture
)

DEAD = 200_000


def _store(dsn: str) -> BatchStore:
    return BatchStore(dsn, "outbox", statement_timeout=60)


def _saved(dsn: str) -> tuple[Any, ...] | None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT low_water, late, seen::text FROM outbox_claim_front").fetchone()


@pytest.mark.usefixtures("held_horizon")
def test_new_session__starts_from_the_saved_front_behind_dead_rows(dsn: str) -> None:
    """Behind 200,000 dead rows and a held snapshot, a relay's next session reads
    about what a claim of the session before read, not the walk from the bottom
    (about 8,000 blocks, which 0.6 read on every relay start and reconnect)."""
    _dead_rows(dsn, DEAD)
    with psycopg.connect(dsn, autocommit=True) as conn:
        _insert(conn, 3 * BATCH)
    before = _store(dsn)
    try:
        walk, _ = claim_cost(dsn, before, "walk")  # the first session ever: the bottom
        steady, _ = claim_cost(dsn, before, "steady")
        before.save_front()
    finally:
        before.close()
    assert _saved(dsn) is not None
    after = _store(dsn)
    try:
        resumed, claimed = claim_cost(dsn, after, "resumed")
    finally:
        after.close()
    assert len(claimed) == BATCH
    assert walk > 5_000, walk
    # One lookup more (the saved front) and the rows claimed since it was saved.
    assert resumed <= steady * 1.5 + 100, (walk, steady, resumed)


@pytest.mark.usefixtures("held_horizon")
def test_new_session__rows_committed_while_no_relay_ran_are_claimed(dsn: str) -> None:
    """A row that took its id before the saved front was computed and committed
    while no relay ran (behind the front) is claimed by the next session, first, and
    so is a dead letter retried under its old id meanwhile; cheaply."""
    _dead_rows(dsn, 20_000)
    late = psycopg.connect(dsn)
    try:
        [late_id] = _insert(late, 1)  # id taken, not committed
        with psycopg.connect(dsn, autocommit=True) as conn:
            early = _insert(conn, BATCH)
        before = _store(dsn)
        try:
            _, first = claim_cost(dsn, before, "first")
            assert first == early
            before.save_front()
        finally:
            before.close()
        late.commit()
    finally:
        late.close()
    with psycopg.connect(dsn, autocommit=True) as conn:
        # A dead letter retried: its old id, far behind the saved front.
        conn.execute(
            "INSERT INTO outbox (id, exchange, routing_key, payload) OVERRIDING SYSTEM VALUE"
            " VALUES (%s, 'x', 'k', 'retried')",
            [early[0]],
        )
        newer = _insert(conn, 3)
    after = _store(dsn)
    try:
        cost, claimed = claim_cost(dsn, after, "after")
    finally:
        after.close()
    assert claimed == [late_id, early[0], *newer]
    assert cost < 500, cost  # the walk from the bottom reads ~1,600


@pytest.mark.parametrize(
    "change",
    [
        "UPDATE outbox_claim_front SET timeline = timeline + 1",
        "UPDATE outbox_claim_front SET system_identifier = system_identifier + 1",
        # A front whose snapshot is ahead of this server's (a restored copy, a
        # cluster reset): the rows inserted now would have txids it says it saw.
        "UPDATE outbox_claim_front SET seen = (SELECT format('%s:%s:', x, x)::pg_snapshot"
        " FROM (SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint + 1000000) AS n(x))",
        # The table rewritten (as restored from a dump, truncated and reloaded).
        "VACUUM FULL outbox",
    ],
    ids=["another_timeline", "another_cluster", "ahead", "another_file"],
)
def test_new_session__ignores_a_front_saved_elsewhere(dsn: str, change: str) -> None:
    """A front saved on another timeline (before a failover) or cluster, for another
    file of the outbox table, or ahead of this server, is ignored: the session
    starts from the bottom and claims a row committed behind that front."""
    late = psycopg.connect(dsn)
    try:
        [late_id] = _insert(late, 1)
        with psycopg.connect(dsn, autocommit=True) as conn:
            early = _insert(conn, 5)
        before = _store(dsn)
        try:
            assert [r.id for r in before.claim_batch(BATCH)] == early
            _commit(before, "early")
            before.claim_batch(BATCH)  # its front is now past every row
            before.abandon_claim()
            before.save_front()
        finally:
            before.close()
        late.commit()
    finally:
        late.close()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(change)
    after = _store(dsn)
    try:
        assert [r.id for r in after.claim_batch(BATCH)] == [late_id]
        after.abandon_claim()
        assert after.saved_front() == ClaimFront()
    finally:
        after.close()


def test_save__keeps_the_fresher_front(dsn: str) -> None:
    """A session with an older front does not replace a fresher one saved by another."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        _insert(conn, 10)
    old, new = _store(dsn), _store(dsn)
    try:
        old.claim_batch(5)
        _commit(old, "old")
        new.claim_batch(5)
        _commit(new, "new")
        new.save_front()
        fresher = _saved(dsn)
        old.save_front()
        assert _saved(dsn) == fresher
        assert fresher is not None and fresher[2] == new.front.seen
    finally:
        old.close()
        new.close()


@pytest.mark.usefixtures("held_horizon")
def test_backlog__counted_from_the_saved_front_without_walking_the_dead_rows(dsn: str) -> None:
    """``outbox status`` and the metrics count the rows where the relays' claims look:
    every row (one committed behind the front, one retried under an old id, the rows
    after it), reading what a claim reads, not the 200,000 dead rows (about 8,000
    blocks, which ``count(*)`` read)."""
    _dead_rows(dsn, DEAD)
    late = psycopg.connect(dsn)
    store = _store(dsn)
    try:
        _insert(late, 1)  # committed after the front is saved
        with psycopg.connect(dsn, autocommit=True) as conn:
            early = _insert(conn, BATCH)
            waiting = _insert(conn, 2 * BATCH)
        _, claimed = claim_cost(dsn, store, "early")
        assert claimed == early
        store.save_front()
        late.commit()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO outbox (id, exchange, routing_key, payload, created_at)"
                " OVERRIDING SYSTEM VALUE VALUES (%s, 'x', 'k', 'retried', now() - interval '1 h')",
                [early[0]],
            )
            [(count,)] = conn.execute("SELECT count(*) FROM outbox").fetchall()
        assert count == len(waiting) + 2
        store.conn.execute("SELECT pg_stat_force_next_flush()")
        before = blocks_read(dsn)
        backlog = store.backlog()
        metrics = store.metrics_snapshot()
        store.conn.execute("SELECT pg_stat_force_next_flush()")
        cost = blocks_read(dsn) - before
    finally:
        late.close()
        store.close()
    assert backlog["rows"] == metrics["backlog_rows"] == count
    # The row created first, whatever its id (the metric took the lowest id's age).
    assert 3_500 < backlog["oldest_age_seconds"] < 3_700
    assert 3_500 < metrics["oldest_row_age_seconds"] < 3_700
    assert cost < 1_000, cost
