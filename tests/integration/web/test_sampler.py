"""The console's charts sampler behind a held horizon (issue 33): every 10 s per table
it counts the backlog and its oldest row's age where the relays' claims look, from
their saved front, as ``outbox status`` does (``outbox.db.front``, "Counting"), not
over every dead row the horizon keeps.

Costs are blocks read (``pg_statio_user_tables``), as in
``tests/integration/db/test_claim_front.py``; no browser, no broker.
"""

from __future__ import annotations

from typing import Any

import psycopg

from outbox.config import Settings
from outbox.db.batches import BatchStore
from outbox.web.console import ConsoleConfig
from outbox.web.sampler import Sampler
from tests.fixtures.faults import wait_for
from tests.integration.db.test_claim_front import (
    BATCH,
    _dead_rows,
    _insert,
    blocks_read,
    claim_cost,
    held_horizon,  # noqa: F401 - a fixture
)

DEAD = 200_000


def _alone(dsn: str, *others: int) -> bool:
    """No session of this database but ours and ``others``: every session closed
    before has ended, and a backend flushes its statistics before it ends (so the
    blocks it read are counted)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND pid <> ALL (%s)",
            [list(others)],
        ).fetchone()
    return row is not None and row[0] == 0


def test_sampler__counts_the_backlog_from_the_saved_front_without_walking_the_dead_rows(
    dsn: str,
    held_horizon: psycopg.Connection[Any],  # noqa: F811 - the fixture, imported above
) -> None:
    """One sample of the charts behind 200,000 dead rows reads what a claim reads: the
    backlog (the rows waiting, and a row retried under an old id behind the front,
    created an hour ago: the oldest) exact, in under 1,000 blocks.  It ran ``count(*)``
    and an ``ORDER BY id LIMIT 1`` from the lowest id: a sequential scan of the bloated
    heap and a walk of the primary key's dead entries, 10,000s of blocks."""
    _dead_rows(dsn, DEAD)
    store = BatchStore(dsn, "outbox", statement_timeout=60)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            early = _insert(conn, BATCH)
            _insert(conn, 2 * BATCH)
        _, claimed = claim_cost(dsn, store, "early")  # a relay's claim, and its front
        assert claimed == early
        store.save_front()
    finally:
        store.close()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (id, exchange, routing_key, payload, created_at)"
            " OVERRIDING SYSTEM VALUE VALUES (%s, 'x', 'k', 'retried', now() - interval '1 h')",
            [early[0]],
        )
        [(count,)] = conn.execute("SELECT count(*) FROM outbox").fetchall()
    assert count == 2 * BATCH + 1
    holder = held_horizon.info.backend_pid
    wait_for(lambda: _alone(dsn, holder), 10, "the sessions before to end")
    sampler = Sampler(ConsoleConfig((Settings(dsn=dsn, statement_timeout=60, lock_timeout=60),)))
    before = blocks_read(dsn)
    sampler.sample()
    wait_for(lambda: _alone(dsn, holder), 10, "the sampler's session to end")
    cost = blocks_read(dsn) - before
    [section] = sampler.charts()
    assert section["error"] is None, section["error"]
    found = {chart.key: chart for chart in section["charts"]}
    assert found["backlog"].latest == count
    assert 3_500 < found["oldest_seconds"].latest < 3_700
    assert (found["dead_rows"].latest or 0) >= DEAD  # the other figures, same statement
    assert (found["horizon_seconds"].latest or 0) > 0
    assert cost < 1_000, cost
