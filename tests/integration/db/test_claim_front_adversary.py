"""The claim front (``outbox.db.front``) against hostile shapes (issue 33's review).

Each test drives ``BatchStore`` claims on a real PostgreSQL as a relay would, with
applications doing what applications do: transactions that take ids early and
commit late, in savepoints or prepared themselves, rows with ids from elsewhere,
a backlog that lands behind the front all at once, and copies of outbox rows
(``CREATE TABLE … AS SELECT * FROM outbox`` now carries ``txid``).  What must
hold: every committed row is claimed exactly once, in per-key id order, at a cost
that does not grow faster than the rows claimed.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from outbox.db import batches, migrate
from outbox.db.batches import BatchStore
from tests.fixtures.faults import wait_for
from tests.integration.db.test_claim_front import blocks_read

BATCH = 100
Conn = psycopg.Connection[Any]


def _insert(conn: Conn, rows: int, *, key: str | None = None) -> list[int]:
    return [
        r[0]
        for r in conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload, ordering_key) "
            "SELECT 'x', 'k', convert_to(repeat('p', 20), 'UTF8'), %s "
            "FROM generate_series(1, %s) RETURNING id",
            [key, rows],
        ).fetchall()
    ]


@contextlib.contextmanager
def _store(dsn: str) -> Iterator[BatchStore]:
    store = BatchStore(dsn, "outbox", statement_timeout=60)
    try:
        yield store
    finally:
        store.close()


def _drain(store: BatchStore, limit: int = BATCH) -> list[int]:
    """Claim and commit until a claim comes back empty: the ids, in claim order."""
    ids: list[int] = []
    for n in range(100_000):
        rows = store.claim_batch(limit)
        if not rows:
            store.abandon_claim()
            return ids
        ids += [r.id for r in rows]
        store.prepare(f"drain_{n}")
        assert store.finish(f"drain_{n}", commit=True)
    raise AssertionError("the drain never ended")


def _drain_cost(dsn: str, store: BatchStore) -> tuple[int, list[int]]:
    store.conn.execute("SELECT pg_stat_force_next_flush()")
    before = blocks_read(dsn)
    ids = _drain(store)
    store.conn.execute("SELECT pg_stat_force_next_flush()")
    return blocks_read(dsn) - before, ids


LATE = 3_000


def _late_transaction(dsn: str, store: BatchStore) -> list[int]:
    """One application transaction takes LATE ids, then another commits a row above
    them and the relay claims it: the front is past them all when it commits."""
    with psycopg.connect(dsn) as late, psycopg.connect(dsn, autocommit=True) as other:
        ids = _insert(late, LATE)
        _insert(other, 1)
        assert len(_drain(store)) == 1
        late.commit()
    return ids


def _high_id(dsn: str, store: BatchStore) -> list[int]:
    """A row with an id from elsewhere (OVERRIDING SYSTEM VALUE, far above the
    sequence; or the sequence restarted): once claimed, the front is above every id
    the sequence hands out, and every later row lands behind it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (id, exchange, routing_key) OVERRIDING SYSTEM VALUE "
            "VALUES (10000000000, 'x', 'k')"
        )
        assert len(_drain(store)) == 1
        return _insert(conn, LATE)


@pytest.mark.parametrize("shape", [_late_transaction, _high_id], ids=["late_txn", "high_id"])
def test_claim__a_backlog_behind_the_front_drains_at_the_cost_of_one_in_front(
    dsn: str, shape: Callable[[str, BatchStore], list[int]]
) -> None:
    """3,000 rows that land behind the front at once (a transaction that took its ids
    early, a backlog behind an id from elsewhere) drain like 3,000 rows in front of
    it.  Each claim looked every late id up again (three times: ``late``, ``keyed``,
    ``late_heads``) and sent and received them all, so draining N late rows in
    batches of B cost N²/B lookups: 100,000 late rows took 58.6 s against 3.0 s in
    front of the front (batches of 1,000), and these 3,000 read ~10x the blocks."""
    with _store(dsn) as store:
        with psycopg.connect(dsn, autocommit=True) as conn:
            normal = _insert(conn, LATE)
        normal_cost, drained = _drain_cost(dsn, store)
        assert drained == normal
    with _store(dsn) as store:
        ids = shape(dsn, store)
        late_cost, drained = _drain_cost(dsn, store)
        assert drained == ids
        assert not store.front.late
    print(f"blocks: {late_cost} late, {normal_cost} in front")
    assert late_cost <= 2 * normal_cost, (late_cost, normal_cost)


def _copied_back(dsn: str, store: BatchStore, ids: list[int]) -> None:
    """An operator's re-drive from a copy: ``CREATE TABLE … AS SELECT * FROM outbox``
    (which now copies ``txid``), the rows relayed, then one copied back under its
    id, which the front has passed."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        _insert(conn, 2)
        assert len(_drain(store)) == 2
        conn.execute(
            "INSERT INTO outbox OVERRIDING SYSTEM VALUE SELECT * FROM outbox_copy WHERE id = %s",
            [ids[0]],
        )


def _explicit_null(dsn: str, store: BatchStore, ids: list[int]) -> None:
    """An application (an ORM whose model was generated from the table) that sends
    every column, ``txid`` NULL, in a transaction that commits after the front
    passed its id."""
    with psycopg.connect(dsn) as late, psycopg.connect(dsn, autocommit=True) as other:
        late.execute("INSERT INTO outbox (exchange, routing_key, txid) VALUES ('x', 'k', NULL)")
        _insert(other, 2)
        assert len(_drain(store)) == 2
        late.commit()


@pytest.mark.parametrize("shape", [_copied_back, _explicit_null], ids=["copied", "null"])
def test_claim__a_row_whose_txid_is_not_its_transactions_is_found_by_the_rescan(
    dsn: str, shape: Callable[[str, BatchStore, list[int]], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row whose txid the application wrote (not the default) and whose id the
    front has passed is invisible to the txid sweep: it was left behind for the
    session's life (until the relay reconnects).  The session's claims start from
    the bottom again every ``RESCAN_SECONDS`` (here 1 s), and find it."""
    monkeypatch.setattr(batches, "RESCAN_SECONDS", 1.0, raising=False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        ids = _insert(conn, 3)
        conn.execute("CREATE TABLE outbox_copy AS SELECT * FROM outbox")
    with _store(dsn) as store:
        assert _drain(store) == ids
        shape(dsn, store, ids)
        with psycopg.connect(dsn, autocommit=True) as conn:
            [(left,)] = conn.execute("SELECT count(*) FROM outbox").fetchall()
        assert left == 1
        wait_for(store.rescan_due, 10, "the rescan")
        assert len(_drain(store)) == 1


def test_claim__late_transactions_of_every_kind_are_claimed_once_in_key_order(
    dsn: str, pg_server: str
) -> None:
    """Two relays' sessions claim (committing, or rolling back a batch now and then)
    between the steps of applications that commit late in every way PostgreSQL
    allows: a row inserted in a released savepoint; 70 rows in 70 nested
    savepoints (the snapshot's subtransaction list overflows: the top-level xid is
    what txid holds); a transaction the application prepares itself (2PC) and
    commits later; one that inserts in several statements over time; one that rolls
    back; three sessions sharing an identity sequence with CACHE 20 (ids far out of
    commit order), committing in reverse.  Every committed row is claimed exactly
    once, each transaction's rows (one ordering key each) in id order, nothing of
    the rolled-back one, and both fronts end with nothing left."""
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE outbox ALTER COLUMN id SET CACHE 20")
    claimed: list[tuple[int, str | None]] = []
    gids = iter(range(10_000))

    def claims(store: BatchStore, times: int = 3) -> None:
        for _ in range(times):
            rows = store.claim_batch(rng.choice([1, 7, BATCH]))
            gid = f"adv_{next(gids)}"
            store.prepare(gid)
            commit = rng.random() > 0.2
            assert store.finish(gid, commit=commit)
            if commit:
                claimed.extend((r.id, r.ordering_key) for r in rows)

    committed: dict[str | None, list[int]] = {}
    with contextlib.ExitStack() as stack:
        stores = [stack.enter_context(_store(dsn)) for _ in range(2)]
        conns = {
            name: stack.enter_context(psycopg.connect(dsn))
            for name in ("savepoint", "nested", "app_2pc", "multi", "rolled_back", "filler")
        }
        caches = [stack.enter_context(psycopg.connect(dsn)) for _ in range(3)]
        conns["filler"].autocommit = True

        def flow() -> None:
            committed.setdefault(None, []).extend(_insert(conns["filler"], rng.randint(1, 30)))
            for store in stores:
                claims(store, rng.randint(1, 3))

        sp = conns["savepoint"]
        sp.execute("SAVEPOINT s")
        committed["savepoint"] = _insert(sp, 1, key="savepoint")
        sp.execute("RELEASE SAVEPOINT s")
        flow()
        nested = conns["nested"]
        committed["nested"] = []
        for i in range(70):
            nested.execute(f"SAVEPOINT s{i}")
            committed["nested"] += _insert(nested, 1, key="nested")
        flow()
        committed["app_2pc"] = _insert(conns["app_2pc"], 3, key="app_2pc")
        committed["multi"] = _insert(conns["multi"], 2, key="multi")
        _insert(conns["rolled_back"], 5, key="rolled_back")
        for n, cache in enumerate(caches):
            committed[f"cache{n}"] = _insert(cache, 3, key=f"cache{n}")
        flow()
        conns["app_2pc"].execute("PREPARE TRANSACTION 'app_2pc'")
        flow()
        for n, cache in enumerate(caches):
            committed[f"cache{n}"] += _insert(cache, 2, key=f"cache{n}")
        committed["multi"] += _insert(conns["multi"], 2, key="multi")
        flow()
        conns["rolled_back"].rollback()
        sp.commit()
        flow()
        nested.commit()
        flow()
        conns["filler"].execute("COMMIT PREPARED 'app_2pc'")
        flow()
        conns["multi"].commit()
        for cache in reversed(caches):
            cache.commit()
            flow()
        for store in stores:  # each relay drains what it can see, then sees nothing
            while rows := store.claim_batch(BATCH):
                claimed.extend((r.id, r.ordering_key) for r in rows)
                store.prepare("adv_last")
                assert store.finish("adv_last", commit=True)
            store.abandon_claim()
            assert not store.has_claimable_rows()
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)
    ids = [i for i, _ in claimed]
    assert sorted(ids) == sorted(i for rows in committed.values() for i in rows)
    for key, rows in committed.items():
        if key is not None:
            assert [i for i, k in claimed if k == key] == sorted(rows), key


def test_upgrade__rows_of_transactions_open_across_the_migration_are_claimed(
    empty_dsn: str,
) -> None:
    """Schema 5 to 6 under applications' transactions: one that inserted before the
    migration and is still open, one the application prepared itself (2PC), and one
    that took its xid before the migration but inserts after it and commits after
    the relay's front passed its rows.  The migration waits for the first two (its
    lock waits for their ROW EXCLUSIVE), so their rows (txid NULL) are committed
    before any claim of the new schema, which walks from the bottom; the third is
    found by its txid.  Every row is claimed exactly once."""
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        migrate.migrate(conn, "outbox", target=5)  # type: ignore[arg-type]
    with contextlib.ExitStack() as stack:
        before = stack.enter_context(psycopg.connect(empty_dsn))
        prepared = stack.enter_context(psycopg.connect(empty_dsn))
        early = stack.enter_context(psycopg.connect(empty_dsn))
        app = stack.enter_context(psycopg.connect(empty_dsn, autocommit=True))
        old_rows = _insert(before, 3) + _insert(prepared, 2)
        prepared.execute("PREPARE TRANSACTION 'app_upgrade'")
        early.execute("SELECT pg_current_xact_id()")  # an xid older than the migration
        blocked: list[migrate.Blocked] = []
        errors: list[BaseException] = []

        def upgrade() -> None:
            try:
                with psycopg.connect(empty_dsn, autocommit=True) as conn:
                    migrate.migrate(conn, "outbox", on_blocked=blocked.append)  # type: ignore[arg-type]
            except BaseException as exc:  # handed to the test's thread
                errors.append(exc)

        thread = threading.Thread(target=upgrade)
        thread.start()
        wait_for(lambda: bool(blocked), 30, "the migration waits for the open transactions")
        before.commit()
        app.execute("COMMIT PREPARED 'app_upgrade'")
        thread.join(timeout=60)
        assert not thread.is_alive() and not errors, errors
        assert migrate.current_version(app, "outbox") == migrate.LATEST_VERSION  # type: ignore[arg-type]
        [(nulls,)] = app.execute("SELECT count(*) FROM outbox WHERE txid IS NULL").fetchall()
        assert nulls == len(old_rows)
        late_rows = _insert(early, 2)
        with _store(empty_dsn) as store:
            later = _insert(app, 3)
            assert _drain(store) == old_rows + later
            early.commit()
            assert _drain(store) == late_rows
        assert app.execute("SELECT count(*) FROM outbox").fetchone() == (0,)
