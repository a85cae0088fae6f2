"""What one claim costs with dead rows in front of the live ones (issue 33).

``python -m outbox.bench.deadrows [--dead 0,100000,1000000] [--live 1000]``

For each count of dead rows: a fresh database on a private cluster, a REPEATABLE
READ snapshot held open (so vacuum can remove nothing, as under a report or
``pg_dump``), that many rows inserted and deleted, then ``--live`` rows inserted
and claimed in batches of ``--batch``, each batch committed (its rows join the
dead ones).  Each claim is first run under ``EXPLAIN (ANALYZE, BUFFERS)`` and
rolled back (the figures), then for real.  Three ways of claiming, side by side:

- ``0.5``: the claim of 0.5 (``CLAIM_0_5``, kept here as the baseline): every
  claim walks from the lowest id;
- ``bottom``: the claim of 0.6 with no front (every claim from the bottom: what
  a relay's first claim of a session costs);
- ``front``: the claim front of 0.6 (``outbox.db.front``): a low-water mark and
  the rows committed behind it found by their txid;
- ``rescan``: the low-water mark without the txid sweep (design B): its claims,
  and every N seconds one claim from the bottom (the ``bottom`` figure) to find
  late rows;
- ``restart``: a relay's new session (its start, every reconnect).  A session
  claims one batch, saves its front (schema 0007) and ends; a new session's first
  claim is measured from the bottom (``today_ms``, ``today_buffers``: what 0.6
  before schema 0007 did on every start and reconnect) and from the saved front
  (``first_ms``, ``first_buffers``: ``BatchStore.saved_front``);
- ``slice``: the claims of ``front`` while the safety net's pass is under way, each
  carrying a slice of the heap (``outbox.db.front.RescanPass``; before schema 0007
  the safety net was one claim from the bottom every 10 minutes, the ``bottom``
  figure).

The first claim of a session walks from the bottom (``first``; but ``restart``); the
figures are the median of the claims after it (``ms``, ``buffers``: shared
blocks hit + read).  A benchmark prints figures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import psycopg
from psycopg import sql

from outbox.db import migrate
from outbox.db.batches import PINNED_CLAIM_PLAN, BatchStore
from outbox.db.devcluster import PostgresCluster
from outbox.db.front import ClaimFront, RescanPass
from outbox.tables import table_identifiers

WAYS = ("0.5", "front", "rescan", "bottom", "restart", "slice")

# The claim statement of outbox-relay 0.5 (``queries.sql``, ``claim_batch``, before
# schema 0006), the baseline these figures compare with.  A copy, because an installed
# benchmark has no history to read it from; a test compares it, to the letter, with
# the statement of the commit that shipped 0.5.0 (tests/unit/bench).
CLAIM_0_5 = """
DELETE FROM {outbox}
WHERE id = ANY (ARRAY (
    WITH keyed AS MATERIALIZED (
        SELECT id, ordering_key FROM {outbox}
        WHERE ordering_key IS NOT NULL
          AND id NOT IN (SELECT unnest(%(own)s::bigint[]))
        ORDER BY id
        LIMIT %(window)s
    ), firsts AS MATERIALIZED (
        SELECT DISTINCT ON (ordering_key) id FROM keyed ORDER BY ordering_key, id
    ), heads AS MATERIALIZED (
        SELECT id, ordering_key, octet_length(payload) AS size FROM {outbox}
        WHERE ordering_key IS NULL OR id IN (SELECT id FROM firsts)
        ORDER BY id
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    ), tails AS MATERIALIZED (
        SELECT id, ordering_key, octet_length(payload) AS size FROM {outbox}
        WHERE id IN (
            SELECT k.id FROM keyed k JOIN heads h ON h.ordering_key = k.ordering_key
            WHERE k.id > h.id)
        ORDER BY id
        LIMIT (SELECT %(limit)s - count(*) FROM heads)
        FOR UPDATE SKIP LOCKED
    ), locked AS (
        SELECT id, ordering_key, size FROM heads
        UNION ALL
        SELECT id, ordering_key, size FROM tails
    ), gaps AS (
        SELECT ordering_key, min(id) AS gap FROM keyed
        WHERE id NOT IN (SELECT id FROM locked)
        GROUP BY ordering_key
    ), taken AS (
        SELECT l.id, l.size FROM locked l LEFT JOIN gaps g ON g.ordering_key = l.ordering_key
        WHERE g.gap IS NULL OR l.id < g.gap
    )
    SELECT id FROM (
        SELECT id, sum(size) OVER (ORDER BY id) - size AS before FROM taken
    ) AS sized
    WHERE before < %(max_bytes)s
))
RETURNING id, message_id, exchange, routing_key, payload, headers, content_type, created_at,
    ordering_key,
    CASE WHEN %(hold)s AND ordering_key IS NOT NULL THEN (
        SELECT min(d.id) FROM {dead_letters} d
        WHERE md5(d.ordering_key) = md5({outbox}.ordering_key)
          AND d.ordering_key = {outbox}.ordering_key AND d.id < {outbox}.id)
    END AS held_by
"""


def _database(admin: str, name: str) -> str:
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = psycopg.conninfo.make_conninfo(admin, dbname=name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate.migrate(conn, "outbox")
    return dsn


def _insert(conn: psycopg.Connection[Any], rows: int, payload: int) -> None:
    chunk = 200_000
    for start in range(0, rows, chunk):
        conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload) "
            "SELECT 'x', 'k', convert_to(repeat('p', %s), 'UTF8') FROM generate_series(1, %s)",
            [payload, min(chunk, rows - start)],
        )


def explain_claim(
    store: BatchStore, limit: int, *, old: bool = False, sliced: bool = False
) -> tuple[float, int]:
    """(ms, shared buffers hit + read) of the claim the store would run next (``old``:
    the claim of 0.5), run under EXPLAIN (ANALYZE, BUFFERS) and rolled back."""
    conn = store.conn
    if old:
        statement: sql.Composable = sql.SQL(CLAIM_0_5.strip()).format(
            **table_identifiers(store.table)
        )
    else:
        statement = store.queries["claim_batch"]
    with conn.transaction(force_rollback=True):
        conn.execute(PINNED_CLAIM_PLAN)
        row = conn.execute(
            sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {}").format(statement),
            store.claim_params(limit, sliced=sliced),
        ).fetchone()
    assert row is not None
    explained = next(iter(row.values()))[0]
    plan = explained["Plan"]
    return float(explained["Execution Time"]), int(
        plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0)
    )


def measure(dsn: str, way: str, dead: int, live: int, batch: int, payload: int) -> dict[str, Any]:
    holder = psycopg.connect(dsn)
    try:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM outbox")  # holds the horizon, as pg_dump
        with psycopg.connect(dsn, autocommit=True) as conn:
            _insert(conn, dead, payload)
            conn.execute("DELETE FROM outbox")
            _insert(conn, live, payload)
        today: tuple[float, int] | None = None
        if way == "restart":
            before = BatchStore(dsn, "outbox", statement_timeout=600)
            try:
                before.claim_batch(batch)
                before.conn.execute("COMMIT")
                before.save_front()
            finally:
                before.close()
        store = BatchStore(dsn, "outbox", statement_timeout=600)
        try:
            if way == "restart":
                today = explain_claim(store, batch)  # from the bottom
                store.front = store.saved_front()
            costs = []
            claims = 0
            while True:
                if way in ("bottom", "0.5"):
                    store.front = ClaimFront()
                elif way == "rescan" and claims:
                    store.front = ClaimFront(store.front.low_water)  # no late rows, no sweep
                elif way == "slice" and claims and store.rescan is None:
                    store.rescan_seconds = 0.0  # a slice with every claim
                    store.rescan = RescanPass(store.heap_pages())
                sliced = store.rescan is not None
                costs.append(explain_claim(store, batch, old=way == "0.5", sliced=sliced))
                rows = store.claim_batch(batch)
                store.conn.execute("COMMIT")
                claims += 1
                if not rows:
                    break
        finally:
            store.close()
    finally:
        holder.close()
    first, steady = costs[0], costs[1:] or costs
    result = {
        "way": way,
        "dead": dead,
        "live": live,
        "claims": claims,
        "first_ms": round(first[0], 2),
        "first_buffers": first[1],
        "ms": round(statistics.median(c[0] for c in steady), 3),
        "buffers": int(statistics.median(c[1] for c in steady)),
    }
    if today is not None:
        result.update(today_ms=round(today[0], 2), today_buffers=today[1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m outbox.bench.deadrows", description=__doc__)
    parser.add_argument("--dead", default="0,100000,1000000", help="dead rows, comma-separated")
    parser.add_argument("--live", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--payload", type=int, default=200, help="payload bytes per row")
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--rescan-seconds", type=float, default=10.0)
    parser.add_argument("--claims-per-second", type=float, default=100.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    deads = [int(d) for d in args.dead.split(",")]
    ways = [w for w in args.ways.split(",") if w]
    results = []
    with PostgresCluster(durable=False) as cluster:
        for dead in deads:
            for way in ways:
                dsn = _database(cluster.dsn, f"dead_{dead}_{way}")
                started = time.monotonic()
                result = measure(dsn, way, dead, args.live, args.batch, args.payload)
                result["seconds"] = round(time.monotonic() - started, 1)
                results.append(result)
                if not args.json:
                    print(json.dumps(result), file=sys.stderr)
    by = {(r["way"], r["dead"]): r for r in results}
    for r in results:
        if r["way"] == "rescan" and ("bottom", r["dead"]) in by:
            # One claim from the bottom every --rescan-seconds, spread over the
            # claims of those seconds.
            full = by[("bottom", r["dead"])]["ms"]
            spread = args.rescan_seconds * args.claims_per_second
            r["ms_with_rescans"] = round(r["ms"] + full / spread, 3)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{'way':8} {'dead':>9} {'first ms':>9} {'first buf':>9} {'ms':>8} {'buffers':>8}")
    for r in results:
        extra = f"  ({r['ms_with_rescans']} ms with rescans)" if "ms_with_rescans" in r else ""
        if "today_ms" in r:
            extra = f"  (first claim from the bottom: {r['today_ms']} ms, {r['today_buffers']} buf)"
        print(
            f"{r['way']:8} {r['dead']:>9} {r['first_ms']:>9} {r['first_buffers']:>9} "
            f"{r['ms']:>8} {r['buffers']:>8}{extra}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
