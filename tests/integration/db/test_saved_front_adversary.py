"""Adversary: the saved claim front (``outbox.db.front``, "A new session") across a
rewrite of the outbox table while a relay's session runs on."""

from __future__ import annotations

import contextlib
import random
from typing import Any

import psycopg

from outbox.db.batches import BatchStore
from tests.integration.db.test_claim_front import BATCH, _commit, _insert


def _store(dsn: str) -> BatchStore:
    return BatchStore(dsn, "outbox", statement_timeout=60)


def test_save__a_session_older_than_a_truncate_and_reload_does_not_vouch_for_the_new_file(
    dsn: str,
) -> None:
    """The outbox truncated and reloaded from a copy (its rows keep the txids the
    copy holds) while a relay's session runs: that session's next save of its
    front, computed on the old file, must not be stamped with the new file's
    filenode (new sessions would trust it and leave the reloaded rows behind W
    until the safety net, up to 15 minutes).  The session starts again from the
    bottom instead, and so does the next one.  Before, the save stamped the
    filenode current at the save, and neither claimed the reloaded rows."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        early = _insert(conn, 5)
        conn.execute("CREATE TABLE outbox_copy AS SELECT * FROM outbox")
        _insert(conn, 1)  # a row after them: the front moves past them to it
    before = _store(dsn)
    try:
        assert [r.id for r in before.claim_batch(len(early))] == early
        _commit(before, "early")
        before.claim_batch(BATCH)  # its front is now past the copied rows
        before.abandon_claim()
        before.save_front()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("TRUNCATE outbox")
            conn.execute("INSERT INTO outbox OVERRIDING SYSTEM VALUE SELECT * FROM outbox_copy")
        before.claim_batch(BATCH)  # a claim after the reload: its front moves on
        before.abandon_claim()
        before.save_front()  # its timer's next save
        assert [r.id for r in before.claim_batch(BATCH)] == early
        before.abandon_claim()
    finally:
        before.close()
    after = _store(dsn)
    try:
        assert [r.id for r in after.claim_batch(BATCH)] == early
        after.abandon_claim()
    finally:
        after.close()


def test_restarts__every_row_claimed_once_and_the_backlog_exact_at_every_step(
    dsn: str, chaos_seed: int
) -> None:
    """Two relays' sessions that save their fronts and restart (a new session from
    the saved front) at random, between applications that commit late or roll
    back, dead letters retried under their old ids, batches rolled back, VACUUM
    FULL and TRUNCATE: after every step ``outbox status``'s backlog (counted from
    the saved front) equals ``count(*)``; at the end every committed row was claimed
    exactly once (a retried one once per insert), and a key's row only while no
    row of its key with a lower id was left."""
    rng = random.Random(chaos_seed)
    keys = [None, "a", "b", "c"]
    inserted: list[int] = []
    published: list[int] = []
    late: list[tuple[psycopg.Connection[Any], list[int]]] = []
    gids = iter(range(100_000))
    with contextlib.ExitStack() as stack:
        admin = stack.enter_context(psycopg.connect(dsn, autocommit=True))
        status = _store(dsn)
        stack.callback(status.close)
        stores = [_store(dsn), _store(dsn)]
        stack.callback(lambda: [s.close() for s in stores])

        def insert(conn: psycopg.Connection[Any], count: int) -> list[int]:
            return [
                r[0]
                for r in conn.execute(
                    "INSERT INTO outbox (exchange, routing_key, payload, ordering_key)"
                    " SELECT 'x', 'k', 'p', (%s::text[])[1 + floor(random() * 4)::int]"
                    " FROM generate_series(1, %s) RETURNING id",
                    [keys, count],
                ).fetchall()
            ]

        def claim(store: BatchStore) -> None:
            rows = store.claim_batch(rng.choice([1, 3, 50]))
            if not rows:
                store.abandon_claim()
                return
            mine = {r.id for r in rows}
            for r in rows:
                if r.ordering_key is None:
                    continue
                (before,) = admin.execute(
                    "SELECT count(*) FROM outbox WHERE ordering_key = %s AND id < %s"
                    " AND NOT id = ANY(%s)",
                    [r.ordering_key, r.id, list(mine)],
                ).fetchone()  # type: ignore[misc]
                assert before == 0, (r.id, r.ordering_key)
            gid = f"rs_{next(gids)}"
            store.prepare(gid)
            commit = rng.random() < 0.8
            assert store.finish(gid, commit=commit)
            if commit:
                published.extend(mine)

        for _ in range(200):
            step = rng.choice(
                [
                    "insert",
                    "insert",
                    "late",
                    "commit",
                    "claim",
                    "claim",
                    "claim",
                    "save",
                    "restart",
                    "retry",
                    "vacuum_full",
                    "truncate",
                ]
            )
            if step == "insert":
                inserted.extend(insert(admin, rng.randint(1, 20)))
            elif step == "late" and len(late) < 3:
                conn = psycopg.connect(dsn)
                late.append((conn, insert(conn, rng.randint(1, 3))))
            elif step == "commit" and late:
                conn, ids = late.pop(rng.randrange(len(late)))
                if rng.random() < 0.8:
                    conn.commit()
                    inserted.extend(ids)
                conn.close()
            elif step == "claim":
                claim(rng.choice(stores))
            elif step == "save":
                rng.choice(stores).save_front()
            elif step == "restart":
                n = rng.randrange(2)
                stores[n].save_front()
                stores[n].close()
                stores[n] = _store(dsn)
            elif step == "retry" and published:
                gone = rng.choice(published)
                (present,) = admin.execute(
                    "SELECT count(*) FROM outbox WHERE id = %s", [gone]
                ).fetchone()  # type: ignore[misc]
                if not present:
                    admin.execute(
                        "INSERT INTO outbox (id, exchange, routing_key, payload, ordering_key)"
                        " OVERRIDING SYSTEM VALUE VALUES (%s, 'x', 'k', 'retried', %s)",
                        [gone, rng.choice(keys)],
                    )
                    inserted.append(gone)
            elif step in ("vacuum_full", "truncate") and not late:
                if step == "truncate":  # what is left is gone, never to be published
                    left = [r[0] for r in admin.execute("SELECT id FROM outbox").fetchall()]
                    admin.execute("TRUNCATE outbox")
                    for i in left:
                        inserted.remove(i)
                else:
                    admin.execute("VACUUM FULL outbox")
            (count,) = admin.execute("SELECT count(*) FROM outbox").fetchone()  # type: ignore[misc]
            assert status.backlog()["rows"] == count, step
        for conn, ids in late:
            conn.commit()
            inserted.extend(ids)
            conn.close()
        for store in stores:
            while True:
                rows = store.claim_batch(BATCH)
                if not rows:
                    store.abandon_claim()
                    break
                gid = f"rs_{next(gids)}"
                store.prepare(gid)
                assert store.finish(gid, commit=True)
                published.extend(r.id for r in rows)
    assert sorted(published) == sorted(inserted)
