"""The mover of scheduled rows (``outbox/db/scheduled.py``) while the MVCC horizon is
held: the rows it moved leave dead entries at the low end of the due index, which
vacuum cannot remove; a move starts past them (``scan_from``), only the sweep reads
them."""

from __future__ import annotations

import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from outbox.db import scheduled
from outbox.db.queries import Queries

MOVED = 200_000


def add_due_rows(conn: psycopg.Connection[Any], count: int, first: int) -> None:
    """Rows already due, written straight into the scheduled table."""
    conn.execute(
        "INSERT INTO outbox_scheduled"
        " (id, message_id, exchange, routing_key, payload, created_at, txid, deliver_at)"
        " SELECT -i, gen_random_uuid(), 'e', 'k', 'x', now(), pg_current_xact_id(),"
        "        now() - interval '5 minutes' + i * interval '1 ms'"
        " FROM generate_series(%s::bigint, %s::bigint) AS i",
        [first, first + count - 1],
    )


def blocks_read(conn: psycopg.Connection[Any], queries: Queries, start: datetime.datetime) -> int:
    plan = conn.execute(
        b"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + queries["move_due"].as_bytes(conn),
        {"scan_from": start, "limit": scheduled.MOVE_LIMIT},
    ).fetchone()
    assert plan is not None
    top = plan["QUERY PLAN"][0]
    print(f"{top['Execution Time']:.2f} ms", end=", ")
    return int(top["Plan"]["Shared Hit Blocks"]) + int(top["Plan"]["Shared Read Blocks"])


def test_mover__reads_only_the_due_rows_while_the_horizon_is_held(dsn: str) -> None:
    queries = Queries("outbox")
    with (
        psycopg.connect(dsn) as holder,
        psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn,
    ):
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM outbox").fetchone()  # the snapshot, held
        conn.execute("SET outbox.mover = on")
        add_due_rows(conn, MOVED, 1)
        covered = None
        moved = 0
        while True:
            move = scheduled.move_due(conn, queries, covered, sweep=False)
            covered, moved = move.covered, moved + move.rows
            if not move.rows:
                break
        assert moved == MOVED
        conn.execute("DELETE FROM outbox")
        add_due_rows(conn, 1, MOVED + 1)
        fast = blocks_read(conn, queries, scheduled.scan_from(covered, sweep=False))
        add_due_rows(conn, 1, MOVED + 2)
        sweep = blocks_read(conn, queries, scheduled.scan_from(covered, sweep=True))
    print(f"a move read {fast} blocks, a sweep {sweep}, {MOVED:,} moved rows behind them")
    assert fast < 100
    assert sweep > 10 * fast, "the dead entries were not there to skip"
