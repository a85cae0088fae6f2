"""The statement KEDA's postgresql scaler polls (``queries.sql``, ``scaler_backlog``),
exactly as ``deploy/kubernetes/overlays/keda/scaledobjects.yaml`` holds it and run as
the role ``deploy/kubernetes/overlays/keda/scaler-role.sql`` creates: the relays'
backlog, counted from the front they saved, with no parameter.

It runs every 30 s whatever happens to the database, so it must stay cheap while a
held horizon keeps a million dead rows in the outbox: these tests count the rows
behind dead rows and a held snapshot, compare with what ``outbox status`` counts,
and pin the plan (no sequential or bitmap scan of the outbox; the blocks read are
those of the live rows, not of the dead ones).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from outbox.db.batches import BatchStore
from tests.fixtures.servers import DbRole
from tests.integration.db.test_claim_front import (
    BATCH,
    _dead_rows,
    _insert,
    claim_cost,
    held_horizon,  # noqa: F401 - a fixture
)

KEDA = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes" / "overlays" / "keda"
DEAD = 100_000


def scaler_query() -> str:
    """The relays' trigger's query, as deployed."""
    for doc in yaml.safe_load_all((KEDA / "scaledobjects.yaml").read_text()):
        for trigger in doc["spec"]["triggers"]:
            if trigger["type"] == "postgresql":
                return str(trigger["metadata"]["query"])
    raise AssertionError("no postgresql trigger in scaledobjects.yaml")


def scaler_role(role: DbRole) -> None:
    """``scaler-role.sql`` for ``role`` (its CREATE ROLE aside: the fixture made it)."""
    text = (KEDA / "scaler-role.sql").read_text()
    statements = [s.strip() for s in re.sub(r"--[^\n]*", "", text).split(";") if s.strip()]
    role.grant(
        *(
            s.replace("outbox_scaler", "{role}")
            for s in statements
            if not s.upper().startswith("CREATE ROLE")
        )
    )


def scaled(role: DbRole) -> tuple[int, dict[str, Any]]:
    """The scaler's figure and its plan (EXPLAIN ANALYZE, BUFFERS), as the role."""
    query = scaler_query()
    with psycopg.connect(role.dsn, autocommit=True) as conn:
        row = conn.execute(query).fetchone()
        assert row is not None
        [[explained]] = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query).fetchall()
    plan: dict[str, Any] = (json.loads(explained) if isinstance(explained, str) else explained)[0]
    return int(row[0]), plan


def nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [plan]
    for child in plan.get("Plans", []):
        found += nodes(child)
    return found


def status_backlog(dsn: str) -> int:
    store = BatchStore(dsn, "outbox", statement_timeout=60)
    try:
        return int(store.backlog()["rows"])
    finally:
        store.close()


def assert_pinned(plan: dict[str, Any]) -> None:
    """Every scan of the outbox goes through an index from a bound: none reads the
    table or a whole index."""
    scans = [n for n in nodes(plan["Plan"]) if n.get("Relation Name") == "outbox"]
    assert scans
    for scan in scans:
        assert scan["Node Type"] in ("Index Scan", "Index Only Scan"), scan["Node Type"]
        assert scan.get("Index Cond"), scan


@pytest.mark.usefixtures("held_horizon")
def test_scaler_backlog__counts_the_backlog_behind_dead_rows_and_a_held_horizon(
    dsn: str, db_role: DbRole
) -> None:
    scaler_role(db_role)
    _dead_rows(dsn, DEAD)
    store = BatchStore(dsn, "outbox", statement_timeout=60)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            _insert(conn, BATCH)
        claim_cost(dsn, store, "drained")  # the relays walked past the dead rows once
        store.save_front()
    finally:
        store.close()
    late = psycopg.connect(dsn)
    try:
        _insert(late, 1)  # its id taken before the rows below, committed after them
        with psycopg.connect(dsn, autocommit=True) as conn:
            _insert(conn, 700)
        late.commit()
    finally:
        late.close()
    figure, plan = scaled(db_role)
    assert figure == 701 == status_backlog(dsn)
    assert_pinned(plan)
    # The live rows' pages and the index path to them; the dead rows' are 3,000+.
    blocks = plan["Plan"]["Shared Hit Blocks"] + plan["Plan"]["Shared Read Blocks"]
    assert blocks < 600, blocks


def test_scaler_backlog__without_a_saved_front_counts_from_the_lowest_id(
    dsn: str, db_role: DbRole
) -> None:
    """A new outbox, or a front saved elsewhere (another timeline): every row."""
    scaler_role(db_role)
    with psycopg.connect(dsn, autocommit=True) as conn:
        _insert(conn, 30)
    assert scaled(db_role)[0] == 30
    store = BatchStore(dsn, "outbox", statement_timeout=60)
    try:
        claim_cost(dsn, store, "drained")
        store.save_front()
    finally:
        store.close()
    with psycopg.connect(dsn, autocommit=True) as conn:
        _insert(conn, 5)
        conn.execute("UPDATE outbox_claim_front SET timeline = timeline + 1")
    figure, plan = scaled(db_role)
    assert figure == 5 == status_backlog(dsn)
    assert_pinned(plan)
