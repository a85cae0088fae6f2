"""The claim front (``outbox.db.front``): claims whose cost does not grow with dead
rows, and that still find every row.

While something holds the MVCC horizon (here a REPEATABLE READ transaction that
read the outbox, as ``pg_dump`` does) vacuum removes no dead row, and a claim that
starts at the lowest id reads every one of them again.  The blocks a claim reads
are counted by PostgreSQL (``pg_statio_user_tables``, flushed on demand), so these
tests compare counts, not times.

And a claim that starts past the rows it saw gone must still find every row that
can come back or commit behind it: a row whose transaction took its id early and
committed late, a row put back by a rolled-back batch (its own relay's, a
resolver's), a row another relay held, a row of a claim session killed before
PREPARE, a dead letter retried under its old id.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from outbox.db.batches import BatchStore
from tests.fixtures.faults import wait_for

BATCH = 100
DEAD = 100_000


def _insert(conn: psycopg.Connection[Any], rows: int, *, key: str | None = None) -> list[int]:
    return [
        r[0]
        for r in conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload, ordering_key) "
            "SELECT 'x', 'k', convert_to(repeat('p', 200), 'UTF8'), %s "
            "FROM generate_series(1, %s) RETURNING id",
            [key, rows],
        ).fetchall()
    ]


def _commit(store: BatchStore, gid: str) -> None:
    store.prepare(gid)
    assert store.finish(gid, commit=True)


def blocks_read(dsn: str) -> int:
    """Blocks of the outbox (heap, indexes, TOAST) read or found in the cache, so far."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT coalesce(heap_blks_read, 0) + coalesce(heap_blks_hit, 0)"
            " + coalesce(idx_blks_read, 0) + coalesce(idx_blks_hit, 0)"
            " + coalesce(toast_blks_read, 0) + coalesce(toast_blks_hit, 0)"
            " + coalesce(tidx_blks_read, 0) + coalesce(tidx_blks_hit, 0)"
            " FROM pg_statio_user_tables WHERE relname = 'outbox'"
        ).fetchone()
    assert row is not None
    return int(row[0])


def claim_cost(dsn: str, store: BatchStore, gid: str) -> tuple[int, list[int]]:
    """Blocks one claim (and its commit) reads, and the ids it claimed."""
    store.conn.execute("SELECT pg_stat_force_next_flush()")
    before = blocks_read(dsn)
    rows = store.claim_batch(BATCH)
    _commit(store, gid)
    # Flushed when the backend is next idle, before it answers.
    store.conn.execute("SELECT pg_stat_force_next_flush()")
    return blocks_read(dsn) - before, [r.id for r in rows]


@pytest.fixture
def held_horizon(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A REPEATABLE READ transaction that read the outbox, held open: no dead row of
    the outbox can be vacuumed while it lasts (autovacuum is off for the table, so
    that its visits do not add to the counts)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE outbox SET (autovacuum_enabled = off)")
    holder = psycopg.connect(dsn)
    holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT count(*) FROM outbox")
    yield holder
    holder.close()


def _dead_rows(dsn: str, count: int) -> None:
    """``count`` rows inserted, claimed and committed (as the relay would)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        _insert(conn, count)
        conn.execute("BEGIN")
        conn.execute("DELETE FROM outbox")
        conn.execute("PREPARE TRANSACTION 'dead_rows'")
        conn.execute("COMMIT PREPARED 'dead_rows'")


@pytest.mark.parametrize("analyzed", [False, True], ids=["stale_stats", "analyzed"])
@pytest.mark.parametrize("key", [None, "k"], ids=["unkeyed", "one_key"])
def test_claim__reads_the_same_blocks_with_dead_rows_behind_a_held_horizon(
    dsn: str, held_horizon: psycopg.Connection[Any], key: str | None, analyzed: bool
) -> None:
    """A claim behind 100,000 dead rows reads about what it reads with none: O(batch),
    not O(dead).  The claim of 0.5 read 5,000 blocks more (one claim walked the
    index and heap pages of every dead row).  ``analyzed``: the statistics were taken
    with no live row (autovacuum's ANALYZE while the relays keep up, the horizon
    held); the generic plan of the safety net's slice then walked the primary key
    below W on every claim (0.55 -> 68 ms per claim in a 10-minute bench run)."""
    costs = {}
    for dead in (0, DEAD):
        _dead_rows(dsn, dead)
        with psycopg.connect(dsn, autocommit=True) as conn:
            if analyzed:  # as autovacuum's ANALYZE when the relays have drained the table
                conn.execute("ANALYZE outbox")
            _insert(conn, 3 * BATCH, key=key)
        store = BatchStore(dsn, "outbox", statement_timeout=60)
        try:
            # The first claim of a session walks from the bottom (``outbox.db.front``).
            claim_cost(dsn, store, f"first_{dead}")
            claim_cost(dsn, store, f"second_{dead}")
            costs[dead], _ = claim_cost(dsn, store, f"third_{dead}")
        finally:
            store.close()
    # 100,000 rows of 200 bytes fill about 3,000 heap pages and 270 index pages,
    # which a walk from the bottom reads.  What may grow: the primary key is a level
    # deeper, one page more per row looked up by id (twice per keyed row).
    assert costs[DEAD] <= costs[0] * 1.2 + 2 * BATCH, costs


def test_claim__a_row_committed_late_behind_the_front_is_claimed_next(
    dsn: str, held_horizon: psycopg.Connection[Any]
) -> None:
    """A transaction takes its row's id, then commits after the relay claimed the rows
    behind it and moved past it: the next claim takes it, reading O(batch) blocks
    behind 100,000 dead rows."""
    _dead_rows(dsn, DEAD)
    late = psycopg.connect(dsn)
    store = BatchStore(dsn, "outbox", statement_timeout=60)
    try:
        [late_id] = _insert(late, 1)  # not committed yet
        with psycopg.connect(dsn, autocommit=True) as conn:
            later = _insert(conn, 2 * BATCH)
        _, first = claim_cost(dsn, store, "first")
        _, second = claim_cost(dsn, store, "second")
        assert first + second == later
        late.commit()
        with psycopg.connect(dsn, autocommit=True) as conn:
            newer = _insert(conn, 5)
        cost, third = claim_cost(dsn, store, "third")
        assert third == [late_id, *newer]
        assert cost < 1_000, cost  # the walk from the bottom reads ~8,000
    finally:
        late.close()
        store.close()


def test_claim__a_late_row_heads_its_key(dsn: str) -> None:
    """A keyed row committed late behind the front is still its key's head: the
    key's later rows wait behind it, also for another relay whose front is past it."""
    early = psycopg.connect(dsn)
    first = BatchStore(dsn, "outbox", statement_timeout=60)
    second = BatchStore(dsn, "outbox", statement_timeout=60)
    try:
        [head] = _insert(early, 1, key="k")  # id taken, not committed
        with psycopg.connect(dsn, autocommit=True) as conn:
            filler = _insert(conn, 10)
        assert [r.id for r in second.claim_batch(BATCH)] == filler
        _commit(second, "filler")
        early.commit()
        with psycopg.connect(dsn, autocommit=True) as conn:
            tail = _insert(conn, 2, key="k")
        assert [r.id for r in first.claim_batch(1)] == [head]
        # The head is held by the first relay's claim: nothing of its key goes.
        assert [r.id for r in second.claim_batch(BATCH)] == []
        second.abandon_claim()
        first.abandon_claim()
        assert [r.id for r in second.claim_batch(BATCH)] == [head, *tail]
        second.abandon_claim()
    finally:
        early.close()
        first.close()
        second.close()


@contextlib.contextmanager
def _stores(dsn: str, count: int) -> Iterator[list[BatchStore]]:
    stores = [BatchStore(dsn, "outbox", statement_timeout=60) for _ in range(count)]
    try:
        yield stores
    finally:
        for store in stores:
            store.close()


def test_claim__rows_rolled_back_or_held_elsewhere_are_claimed_again(dsn: str) -> None:
    """Rows a claim moved past while they were held are claimed once free: another
    relay's batch rolled back by a resolver, the relay's own batch rolled back, a
    claim whose session was killed before PREPARE, and rows that were only
    skipped because someone held them."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        ids = _insert(conn, 6 * BATCH)
    with _stores(dsn, 3) as (relay, other, killed):
        resolved = [r.id for r in other.claim_batch(BATCH)]
        other.prepare("other")  # a dead relay's batch, in doubt
        skipped = [r.id for r in killed.claim_batch(BATCH)]  # not prepared yet
        own = [r.id for r in relay.claim_batch(BATCH)]
        relay.prepare("own")
        assert relay.finish("own", commit=False)  # the relay's own rollback
        taken = [r.id for r in relay.claim_batch(BATCH)]
        _commit(relay, "taken")
        assert taken == own
        rest = [r.id for r in relay.claim_batch(3 * BATCH)]
        _commit(relay, "rest")
        assert rest == ids[3 * BATCH :]
        # Every row the relay could see is claimed; its front is past them all.
        assert relay.claim_batch(BATCH) == []
        relay.abandon_claim()
        # The killed claim's session ends: its rows are free again.
        pid = killed.conn.info.backend_pid
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", [pid])
            gone = "SELECT NOT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = %s)"
            wait_for(lambda: conn.execute(gone, [pid]).fetchone() == (True,), 10, "backend gone")
            # A resolver rolls the other relay's batch back.
            conn.execute("ROLLBACK PREPARED 'other'")
        back = [r.id for r in relay.claim_batch(3 * BATCH)]
        _commit(relay, "back")
        assert back == sorted(resolved + skipped)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)


def test_claim__a_row_put_back_under_an_old_id_is_claimed(dsn: str) -> None:
    """A dead letter retried keeps its id (OVERRIDING SYSTEM VALUE), far behind the
    front: it is found by the transaction that put it back."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        ids = _insert(conn, 2 * BATCH)
    with _stores(dsn, 1) as (store,):
        assert [r.id for r in store.claim_batch(2 * BATCH)] == ids
        _commit(store, "all")
        with psycopg.connect(dsn, autocommit=True) as conn:
            later = _insert(conn, 5)
        assert [r.id for r in store.claim_batch(BATCH)] == later
        _commit(store, "later")
        assert store.claim_batch(BATCH) == []  # the front is past every id above
        store.abandon_claim()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO outbox (id, exchange, routing_key) OVERRIDING SYSTEM VALUE "
                "VALUES (%s, 'x', 'k')",
                [ids[0]],
            )
        assert [r.id for r in store.claim_batch(BATCH)] == [ids[0]]
        store.abandon_claim()


def test_polls__do_not_walk_the_dead_rows_behind_the_front(
    dsn: str, held_horizon: psycopg.Connection[Any]
) -> None:
    """The idle relay's poll and the drain's last look start where the claim does,
    and still see a row committed late behind it."""
    from outbox.db.relays import WakeupListener

    _dead_rows(dsn, DEAD)
    with _stores(dsn, 1) as (store,):
        with psycopg.connect(dsn, autocommit=True) as conn:
            _insert(conn, BATCH)
        store.claim_batch(BATCH)
        _commit(store, "all")
        assert store.claim_batch(BATCH) == []
        store.abandon_claim()
        listener = WakeupListener(dsn, "outbox")
        try:
            listener.conn.execute("SELECT pg_stat_force_next_flush()")
            store.conn.execute("SELECT pg_stat_force_next_flush()")
            before = blocks_read(dsn)
            assert not listener.rows_waiting(store.front)
            assert not store.has_claimable_rows()
            listener.conn.execute("SELECT pg_stat_force_next_flush()")
            store.conn.execute("SELECT pg_stat_force_next_flush()")
            assert blocks_read(dsn) - before < 100  # from the bottom: ~8,000
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(
                    "INSERT INTO outbox (id, exchange, routing_key) OVERRIDING SYSTEM VALUE "
                    "VALUES (1, 'x', 'k')"
                )
            assert listener.rows_waiting(store.front)
            assert store.has_claimable_rows()
        finally:
            listener.close()


def test_claim__a_bulk_load_committed_late_is_read_once_and_claimed_in_order(
    dsn: str, held_horizon: psycopg.Connection[Any]
) -> None:
    """A long transaction writes 20,000 rows while others flow and are claimed: the
    claims do not read its rows while it runs (its transaction is looked up once it
    has ended), and once it commits they take its rows in id order, each claim
    reading O(batch) again after the first."""
    bulk = psycopg.connect(dsn)
    try:
        with _stores(dsn, 1) as (store,), psycopg.connect(dsn, autocommit=True) as conn:
            _insert(conn, 10)
            claim_cost(dsn, store, "first")
            loaded = _insert(bulk, 20_000)  # not committed
            _insert(conn, 10)
            claim_cost(dsn, store, "started")  # reads the running load's rows, once
            other = _insert(conn, 10)
            cost, ids = claim_cost(dsn, store, "running")
            assert ids == other
            assert cost < 300, cost  # reading the load's 20,000 rows: ~800
            bulk.commit()
            _, ids = claim_cost(dsn, store, "committed")
            assert ids == loaded[:BATCH]
            cost, ids = claim_cost(dsn, store, "next")
            assert ids == loaded[BATCH : 2 * BATCH]
            assert cost < 1_000, cost  # looking 20,000 late ids up: ~80,000
    finally:
        bulk.close()
