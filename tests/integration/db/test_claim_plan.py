"""The hot statements keep one plan whatever the table's statistics say.

An outbox is empty most of the time and autovacuum analyzes it between bursts, so
its statistics usually say "nearly empty" (pages on disk, no live tuple) when the
next burst arrives.  Written as ``id IN (SELECT … FOR UPDATE SKIP LOCKED)``, the
claim then became a nested-loop semi-join rescanning the locking sub-select once
per outer row: 50 s per claim and 19,994 rows deleted under ``LIMIT 1000``.  These
tests reproduce such statistics and pin the plans with ``EXPLAIN (ANALYZE, FORMAT
JSON)``: every ``LockRows`` node runs exactly once, as an InitPlan, and a claim
never returns more than its limit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox.db.batches import KEYED_WINDOW, PINNED_CLAIM_PLAN, BatchStore
from outbox.db.front import ClaimFront
from outbox.db.queries import Queries

LIMIT = 100
ROWS = 3_000

# The statement as it was before: kept here only to prove that the checker below
# catches a rescanned LockRows.
OLD_CLAIM = sql.SQL(
    "DELETE FROM outbox WHERE id IN ("
    " SELECT id FROM outbox ORDER BY id LIMIT %(limit)s FOR UPDATE SKIP LOCKED)"
    " RETURNING id"
)

# Planner settings that push a semi-join towards a nested loop with the sub-select
# on the inner side: the worst plan the planner could choose by itself.
ADVERSARIAL_PLANNER = ("enable_hashagg", "enable_sort", "enable_material")


# How many ordering keys the rows of a case share (None: no key): unkeyed rows are
# claimed by the `heads` step alone; 30 keys by heads and tails; one key by one head
# and its tail.
KEYS: dict[str, int | None] = {"unkeyed": None, "30_keys": 30, "one_key": 1}
_keys: int | None = None


def _fill(conn: psycopg.Connection[Any], rows: int) -> None:
    conn.execute(
        "INSERT INTO outbox (exchange, routing_key, payload, ordering_key) "
        "SELECT 'x', 'k', convert_to(repeat('p', 900), 'UTF8'), "
        "       CASE WHEN %(keys)s::int IS NOT NULL THEN (i %% %(keys)s::int)::text END "
        "FROM generate_series(1, %(rows)s) i",
        {"rows": rows, "keys": _keys},
    )


def claim_params(limit: int) -> dict[str, Any]:
    return {
        "limit": limit,
        "window": limit * KEYED_WINDOW,
        "max_bytes": 2**40,
        "hold": True,
        "own": [],
        "slice_from": "(0,0)",
        "slice_to": "(0,0)",
        **ClaimFront().params(),
    }


def _analyzed_empty_after_churn(conn: psycopg.Connection[Any]) -> None:
    """Pages on disk, zero live tuples in the statistics, then a burst."""
    _fill(conn, ROWS)
    conn.execute("DELETE FROM outbox")
    conn.execute("ANALYZE outbox")
    _fill(conn, ROWS)


def _vacuumed_empty(conn: psycopg.Connection[Any]) -> None:
    conn.execute("VACUUM ANALYZE outbox")
    _fill(conn, ROWS)


def _fresh_statistics(conn: psycopg.Connection[Any]) -> None:
    _fill(conn, ROWS)
    conn.execute("ANALYZE outbox")


def _few_live_rows_many_pages(conn: psycopg.Connection[Any]) -> None:
    _fill(conn, ROWS)
    conn.execute("DELETE FROM outbox WHERE id % 1000 <> 0")
    conn.execute("VACUUM ANALYZE outbox")
    _fill(conn, ROWS)


STATISTICS: dict[str, Callable[[psycopg.Connection[Any]], None]] = {
    "analyzed_empty_after_churn": _analyzed_empty_after_churn,
    "vacuumed_empty": _vacuumed_empty,
    "fresh_statistics": _fresh_statistics,
    "few_live_rows_many_pages": _few_live_rows_many_pages,
}


def _nodes(node: dict[str, Any], path: tuple[dict[str, Any], ...] = ()) -> Iterator[Any]:
    yield node, path
    for child in node.get("Plans", []):
        yield from _nodes(child, (*path, node))


def explain(
    conn: psycopg.Connection[Any],
    statement: sql.Composable,
    params: dict[str, Any],
    *,
    adversarial: bool = False,
    generic: bool = False,
) -> dict[str, Any]:
    """EXPLAIN ANALYZE in a transaction that is rolled back (the claim deletes), with
    the planner settings the relay gives its claims; ``generic``: the plan the server
    reuses once the driver has prepared the statement (``PINNED_CLAIM_PLAN``)."""
    with conn.transaction(force_rollback=True):
        conn.execute(PINNED_CLAIM_PLAN)
        if adversarial:
            for setting in ADVERSARIAL_PLANNER:
                conn.execute(sql.SQL("SET LOCAL {} = off").format(sql.Identifier(setting)))
        if generic:
            row = _explain_generic(conn, statement, params)
        else:
            row = conn.execute(
                sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) {}").format(statement), params
            ).fetchone()
    assert row is not None
    plan: dict[str, Any] = row[0][0]["Plan"]
    return plan


# The claim's parameters in the order of a server-side PREPARE, with their types.
CLAIM_PARAMETERS = {
    "limit": "bigint",
    "window": "bigint",
    "max_bytes": "bigint",
    "hold": "boolean",
    "own": "bigint[]",
    "low_water": "bigint",
    "late": "bigint[]",
    "seen": "text",
    "slice_from": "tid",
    "slice_to": "tid",
}


def _explain_generic(
    conn: psycopg.Connection[Any], statement: sql.Composable, params: dict[str, Any]
) -> Any:
    """EXPLAIN ANALYZE EXECUTE of the statement prepared on the server, which under
    ``plan_cache_mode = force_generic_plan`` runs the generic plan."""
    text = statement.as_string(conn)
    names = [name for name in CLAIM_PARAMETERS if f"%({name})s" in text]
    for number, name in enumerate(names, 1):
        text = text.replace(f"%({name})s", f"${number}")
    types = ", ".join(CLAIM_PARAMETERS[name] for name in names)
    conn.execute(f"PREPARE generic_claim ({types}) AS {text}")
    try:
        values = sql.SQL(", ").join(sql.Literal(params[name]) for name in names)
        return conn.execute(
            sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE generic_claim ({})").format(values)
        ).fetchone()
    finally:
        conn.execute("DEALLOCATE generic_claim")


def deleted(plan: dict[str, Any]) -> int:
    """Rows the claim deleted (its result has one more record: the next front)."""
    [node] = [n for n, _ in _nodes(plan) if n["Node Type"] == "ModifyTable"]
    return int(node["Actual Rows"])


def locking_problems(plan: dict[str, Any]) -> list[str]:
    """Why the plan's locking step may run more than once (empty: it runs once)."""
    problems = []
    lock_nodes = [(n, p) for n, p in _nodes(plan) if n["Node Type"] == "LockRows"]
    if not lock_nodes:
        problems.append("no LockRows node")
    for node, path in lock_nodes:
        # Each runs at most once (the tails' one not at all when the heads fill the batch).
        if node["Actual Loops"] > 1:
            problems.append(f"LockRows ran {node['Actual Loops']} times")
        relationships = [n.get("Parent Relationship") for n in (*path, node)]
        if "InitPlan" not in relationships:
            problems.append(f"LockRows is not in an InitPlan (path: {relationships})")
        if "Inner" in relationships:
            problems.append("LockRows is on the inner side of a join")
    return problems


@pytest.fixture(params=list(KEYS))
def keys(request: pytest.FixtureRequest) -> Iterator[int | None]:
    global _keys
    _keys = KEYS[request.param]
    yield _keys
    _keys = None


@pytest.mark.parametrize("generic", [False, True], ids=["custom_plan", "generic_plan"])
@pytest.mark.parametrize("adversarial", [False, True], ids=["planner", "adversarial_planner"])
@pytest.mark.parametrize("statistics", list(STATISTICS))
def test_claim_plan__locks_once_and_claims_at_most_limit(
    dsn: str, statistics: str, adversarial: bool, keys: int | None, generic: bool
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        STATISTICS[statistics](conn)
        plan = explain(
            conn,
            Queries("outbox")["claim_batch"],
            claim_params(LIMIT),
            adversarial=adversarial,
            generic=generic,
        )
        assert locking_problems(plan) == []
        assert deleted(plan) == LIMIT
        assert plan["Actual Rows"] == LIMIT + 1  # and the next front
        # The keyed front is read up to its window, never by walking the whole table
        # (with no keyed row at all: through the partial index, reading nothing).
        [front] = [n for n, _ in _nodes(plan) if n.get("Subplan Name") == "CTE keyed"]
        for node, _ in _nodes(front):
            read = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
            assert read <= LIMIT * KEYED_WINDOW, (node["Node Type"], read)

    store = BatchStore(dsn, "outbox", statement_timeout=30)
    try:
        rows = store.claim_batch(LIMIT)
        assert len(rows) == LIMIT
        assert len({r.id for r in rows}) == LIMIT
        store.abandon_claim()
    finally:
        store.close()


def test_claim_plan__checker_catches_the_rescanned_semi_join(dsn: str) -> None:
    """The old statement under bad statistics: the checker must see the rescans."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        _fill(conn, 300)
        conn.execute("DELETE FROM outbox")
        conn.execute("ANALYZE outbox")
        _fill(conn, 300)
        plan = explain(conn, OLD_CLAIM, {"limit": 10}, adversarial=True)
    problems = locking_problems(plan)
    assert any("ran" in p for p in problems), problems
    # …and it deletes more rows than its LIMIT: the bug the new statement removes.
    assert plan["Actual Rows"] > 10


@pytest.mark.parametrize("statistics", list(STATISTICS))
def test_claim_plan__claimable_rows_probe_locks_once(dsn: str, statistics: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        STATISTICS[statistics](conn)
        plan = explain(
            conn, Queries("outbox")["has_claimable_rows"], ClaimFront().params(), adversarial=True
        )
    # One look per place the claim looks; the first that finds a row ends it.
    loops = [n["Actual Loops"] for n, _ in _nodes(plan) if n["Node Type"] == "LockRows"]
    assert loops == [1, 0, 0, 0], loops


def test_claim_plan__claims_of_two_sessions_never_overlap(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        _analyzed_empty_after_churn(conn)
    first = BatchStore(dsn, "outbox", statement_timeout=30)
    second = BatchStore(dsn, "outbox", statement_timeout=30)
    try:
        a = {r.id for r in first.claim_batch(LIMIT)}
        b = {r.id for r in second.claim_batch(LIMIT)}
        assert len(a) == len(b) == LIMIT
        assert not a & b
    finally:
        first.abandon_claim()
        second.abandon_claim()
        first.close()
        second.close()


def _payload_sizes(dsn: str, sizes: list[int]) -> None:
    with psycopg.connect(dsn) as conn:
        for size in sizes:
            conn.execute(
                "INSERT INTO outbox (exchange, routing_key, payload) "
                "VALUES ('x', 'k', convert_to(repeat('p', %s), 'UTF8'))",
                [size],
            )


@pytest.mark.parametrize(
    ("sizes", "max_bytes", "claimed"),
    [
        ([1000] * 10, 2500, 3),  # 0, 1000, 2000 bytes before each: under the budget
        ([1000] * 10, 3000, 3),  # the row that would start at 3000 waits
        ([10_000, 10, 10], 100, 1),  # a row larger than the budget goes alone
        ([10, 10, 10_000, 10], 100, 3),  # …or closes a batch it starts within
        ([0] * 20, 1, 5),  # empty payloads: the row count still limits
    ],
)
def test_claim__stops_at_the_byte_budget(
    dsn: str, sizes: list[int], max_bytes: int, claimed: int
) -> None:
    _payload_sizes(dsn, sizes)
    first = BatchStore(dsn, "outbox", statement_timeout=30)
    second = BatchStore(dsn, "outbox", statement_timeout=30)
    try:
        rows = first.claim_batch(5, max_bytes)
        assert len(rows) == claimed
        assert [len(r.payload) for r in rows] == sizes[:claimed]
        # Rows locked beyond the budget are skipped by others until the batch ends…
        assert len(second.claim_batch(100)) == len(sizes) - min(5, len(sizes))
        second.abandon_claim()
        first.abandon_claim()
        # …and then nothing was lost: every row is claimable again.
        assert len(second.claim_batch(100)) == len(sizes)
    finally:
        second.abandon_claim()
        first.close()
        second.close()


# Thresholds at which any plan is JIT-compiled, with inlining and optimization: what
# a claim's estimated cost reached on a never-vacuumed table grown by churn (560,000
# on 31,000 pages: 0.5-0.9 s of LLVM per claim of 100 rows, 1.5 ms of execution).
JIT_EVERYTHING = ("jit_above_cost", "jit_inline_above_cost", "jit_optimize_above_cost")


@pytest.mark.parametrize("generic", [False, True], ids=["custom_plan", "generic_plan"])
def test_claim_plan__never_jit_compiled(dsn: str, generic: bool) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for setting in JIT_EVERYTHING:
            conn.execute(sql.SQL("SET {} = 0").format(sql.Identifier(setting)))
        row = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) SELECT 1").fetchone()
        assert row is not None
        if "JIT" not in row[0][0]:
            pytest.skip("this server cannot JIT-compile (no llvmjit, or jit = off)")
        _fill(conn, ROWS)
        with conn.transaction(force_rollback=True):
            conn.execute(PINNED_CLAIM_PLAN)
            statement = Queries("outbox")["claim_batch"]
            if generic:
                row = _explain_generic(conn, statement, claim_params(LIMIT))
            else:
                row = conn.execute(
                    sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) {}").format(statement),
                    claim_params(LIMIT),
                ).fetchone()
    assert row is not None
    explained = row[0][0]
    assert deleted(explained["Plan"]) == LIMIT
    assert "JIT" not in explained, explained["JIT"]


@pytest.mark.parametrize("adversarial", [False, True], ids=["planner", "adversarial_planner"])
@pytest.mark.parametrize("generic", [False, True], ids=["custom_plan", "generic_plan"])
def test_claim_plan__own_rows_are_looked_up_by_hash(
    dsn: str, generic: bool, adversarial: bool
) -> None:
    """Behind the relay's own batch (``own``: one row of each of ``LIMIT`` keys) the
    claim takes each key's next row, none of ``own``, and finds ``own`` through a
    hash: ``id <> ALL (%(own)s)`` compared every row of the window with every element
    of the array in the generic plan (65 of a keyed claim's 85 ms at batch 1,000)."""
    global _keys
    _keys = LIMIT
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            _fill(conn, ROWS)
            ids = [r[0] for r in conn.execute("SELECT id FROM outbox ORDER BY id").fetchall()]
            own, after = ids[:LIMIT], ids[LIMIT : 2 * LIMIT]
            params = {**claim_params(LIMIT), "own": own}
            plan = explain(
                conn,
                Queries("outbox")["claim_batch"],
                params,
                generic=generic,
                adversarial=adversarial,
            )
    finally:
        _keys = None
    assert locking_problems(plan) == []
    assert deleted(plan) == LIMIT
    [front] = [n for n, _ in _nodes(plan) if n.get("Subplan Name") == "CTE keyed"]
    filters = [n.get("Filter", "") for n, _ in _nodes(front)]
    assert not any("<> ALL" in f for f in filters), filters
    assert any("hashed SubPlan" in f for f in filters), filters

    store = BatchStore(dsn, "outbox", statement_timeout=30)
    try:
        rows = store.claim_batch(LIMIT, own=own)
        assert [r.id for r in rows] == after  # each key's next row, in id order
        store.abandon_claim()
    finally:
        store.close()


@pytest.mark.parametrize("generic", [False, True], ids=["custom_plan", "generic_plan"])
@pytest.mark.parametrize("statistics", list(STATISTICS))
def test_claim_plan__starts_at_the_front_through_indexes(
    dsn: str, statistics: str, generic: bool
) -> None:
    """With a front (``outbox.db.front``) the claim reads the outbox only through its
    indexes: the primary key from W on, the late ids by id, the rows committed since
    the last snapshot through the txid index, and a slice of the safety net by a TID
    range scan of its pages; never a sequential scan, which would read every dead
    row from the start of the table."""
    global _keys
    _keys = 30
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            STATISTICS[statistics](conn)
            ids = [r[0] for r in conn.execute("SELECT id FROM outbox ORDER BY id").fetchall()]
            seen = conn.execute("SELECT pg_current_snapshot()::text").fetchone()
            assert seen is not None
            _fill(conn, 10)  # committed after the snapshot: found by their txid
            front = ClaimFront(ids[len(ids) // 2], (ids[0], ids[1]), seen[0])
            params = {**claim_params(LIMIT), **front.params(), "slice_to": "(2,0)"}
            plan = explain(conn, Queries("outbox")["claim_batch"], params, generic=generic)
    finally:
        _keys = None
    assert locking_problems(plan) == []
    assert deleted(plan) == LIMIT
    nodes = [n for n, _ in _nodes(plan)]
    assert not [n for n in nodes if n["Node Type"] == "Seq Scan"]
    # Every index scan has a condition: none reads an index from its start.
    assert all("Index Cond" in n for n in nodes if "Index" in n["Node Type"]), [
        (n["Node Type"], n.get("Index Name"), n.get("Filter")) for n in nodes
    ]
    assert any(n.get("Index Name") == "outbox_txid" for n in nodes)
    [sliced] = [n for n in nodes if n["Node Type"] == "Tid Range Scan"]
    assert "TID Cond" in sliced, sliced
    # The keyed window and the heads start at W: a walk from the bottom would read
    # the first half of the table.
    [window] = [n for n, _ in _nodes(plan) if n.get("Subplan Name") == "CTE keyed"]
    for node, _ in _nodes(window):
        read = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
        assert read <= LIMIT * KEYED_WINDOW + 10, (node["Node Type"], read)
    [heads] = [n for n, _ in _nodes(plan) if n.get("Subplan Name") == "CTE front_heads"]
    assert any(
        ">=" in n.get("Index Cond", "") for n, _ in _nodes(heads) if "Index" in n["Node Type"]
    )


@pytest.mark.parametrize("generic", [False, True], ids=["custom_plan", "generic_plan"])
def test_claim_plan__passes_rows_of_prepared_batches_without_locking_them(
    dsn: str, generic: bool
) -> None:
    """Rows that another batch holds prepared (deleted, not committed: visible to
    the claim's snapshot) are left by the heads' scan itself, by their xmax, not
    handed to LockRows to be skipped after a try in the lock manager: with 4 relays
    a claim passed 7 batches of them, and the tries took 7 of its 20 ms of CPU.  Once
    that batch is rolled back, its rows are claimed again (W never passed them)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        _vacuumed_empty(conn)
    holder = BatchStore(dsn, "outbox", statement_timeout=30)
    try:
        held = holder.claim_batch(LIMIT)
        assert len(held) == LIMIT
        holder.prepare("obx:outbox:test-holder:1")
        with psycopg.connect(dsn, autocommit=True) as conn:
            plan = explain(
                conn, Queries("outbox")["claim_batch"], claim_params(LIMIT), generic=generic
            )
        [heads] = [n for n, _ in _nodes(plan) if n.get("Subplan Name") == "CTE front_heads"]
        [scan] = [n for n, _ in _nodes(heads) if n["Node Type"] == "Index Scan"]
        [lock] = [n for n, _ in _nodes(heads) if n["Node Type"] == "LockRows"]
        assert scan.get("Rows Removed by Filter", 0) == LIMIT  # the held rows, read once
        assert lock["Actual Rows"] == scan["Actual Rows"] == LIMIT  # none skipped there
        assert deleted(plan) == LIMIT
        holder.finish("obx:outbox:test-holder:1", commit=False)
        store = BatchStore(dsn, "outbox", statement_timeout=30)
        try:
            first = store.claim_batch(LIMIT)
            assert [r.id for r in first] == sorted(r.id for r in held)
            store.abandon_claim()
        finally:
            store.close()
    finally:
        holder.close()
