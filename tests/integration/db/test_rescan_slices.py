"""The safety net in slices (``outbox.db.front.RescanPass``): a row whose txid the
application wrote is still found, and no claim of the pass reads more than its
slice, however many dead rows a held horizon keeps.

Costs are blocks read (``pg_statio_user_tables``), as in ``test_claim_front``.
"""

from __future__ import annotations

import time

import psycopg
import pytest

from outbox.db import batches, front
from tests.fixtures.faults import stamping
from tests.integration.db.test_claim_front import (
    BATCH,
    _dead_rows,
    _insert,
    claim_cost,
    held_horizon,  # noqa: F401 - a fixture
)

DEAD = 200_000


@pytest.mark.usefixtures("held_horizon")
def test_rescan__finds_a_row_with_a_written_txid_in_slices_each_claim_bounded(
    dsn: str,
) -> None:
    """Behind 200,000 dead rows (about 6,000 heap pages), a row with a NULL txid
    committed behind the front is found by the pass, and no claim reads much more
    than a slice (128 pages) beyond what a claim reads anyway: the rescan of 0.6
    before schema 0007 was one claim from the bottom reading about 8,000 blocks."""
    _dead_rows(dsn, DEAD)
    app = psycopg.connect(dsn)
    store = batches.BatchStore(dsn, "outbox", statement_timeout=60)
    # A slice every millisecond; the pass begins when the test says.
    store.rescan_seconds = 2 * front.RESCAN_SLICES / 1000
    stamping(dsn, on=False)  # the row keeps the txid it is written with
    try:
        [(late_id,)] = app.execute(
            "INSERT INTO outbox (exchange, routing_key, payload, txid)"
            " VALUES ('x', 'k', 'null txid', NULL) RETURNING id"
        ).fetchall()
        with psycopg.connect(dsn, autocommit=True) as conn:
            early = _insert(conn, BATCH)
        first, claimed = claim_cost(dsn, store, "first")  # from the bottom
        store._rescan_at = time.monotonic() + 3600  # the pass begins when the test says
        assert claimed == early
        assert first > 5_000, first
        app.commit()
        stamping(dsn, on=True)
        steady, claimed = claim_cost(dsn, store, "steady")
        assert claimed == [] and store.rescan is None
        store._rescan_at = 0.0
        costs = []
        found: list[int] = []
        deadline = time.monotonic() + 60
        while not found:
            assert time.monotonic() < deadline, costs
            while not store.rescan_due():
                time.sleep(0.001)
            cost, found = claim_cost(dsn, store, f"slice_{len(costs)}")
            costs.append(cost)
        assert found == [late_id]
        # The pass began at the first claim due: its slices so far.
        assert 2 <= len(costs) <= front.RESCAN_SLICES, costs
        assert max(costs) <= steady + front.SLICE_PAGES_MIN + 100, (steady, costs)
    finally:
        app.close()
        store.close()


def test_rescan__an_idle_relays_slices_read_nothing_on_an_empty_outbox(dsn: str) -> None:
    """A pass over a table with no page yet is over at once."""
    store = batches.BatchStore(dsn, "outbox", statement_timeout=60)
    try:
        assert store.claim_batch(BATCH) == []  # the saved front, none
        store.abandon_claim()
        store._rescan_at = 0.0
        assert store.rescan_due()
        assert store.claim_batch(BATCH) == []
        store.abandon_claim()
        assert store.rescan is None
    finally:
        store.close()
