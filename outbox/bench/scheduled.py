"""``outbox bench --scheduled``: scheduled delivery (schema 0009) under load.

Rows written with a ``deliver_at`` in the future wait in ``<outbox>_scheduled``,
where no claim looks; the relay's mover moves them into the outbox when due
(``outbox.db.scheduled``).  This scenario measures what a large scheduled backlog
costs the rows due now, and how late the scheduled rows arrive.  Three shapes, each
with its own outbox table, queue, relay (default settings), writer and consumer;
the first two side by side, so that both meet the same load of the machine (a
control run after or before the other meets a different one on a shared machine),
then the third alone (``PHASES``):

- ``none``: an application commits ``rate`` rows/s due now (transactions of
  ``rows_per_commit`` rows, ``payload``-byte payloads), nothing scheduled: the
  control;
- ``backlog``: the same, with ``scheduled`` rows waiting, due evenly from an hour
  after the run's start to ``days`` later (written before the run through the
  outbox's trigger with ``INSERT … SELECT generate_series``, then vacuumed and
  analyzed as an old table would be, and a CHECKPOINT: the run measures the
  backlog waiting, not the writes of its making);
- ``due``: the same backlog and the same immediate rows, plus rows coming due at
  ``due_rate`` rows/s for the length of the run (scheduled just before it, through
  the trigger, due from the immediate rows' first commit on).

Holders (``holders``): ``none``, and ``snapshot``, a REPEATABLE READ transaction
that read the outbox, held for the whole run (``outbox.bench.horizon.hold``): the
rows moved and claimed stay as dead rows and dead index entries.

Figures per run: commit → delivery latency of the immediate rows (p50/p99; the
application's clock and the consumer's are the same machine's CLOCK_MONOTONIC) and
its ratio to the control beside it; the scheduled rows' lateness,
due time → delivery (p50/p99/max; the due time is the database server's clock,
the delivery the bench's wall clock: the same machine's on the private cluster);
the relay's own calls of the claim and of the mover over the run (calls, and per
call: milliseconds, shared buffers hit + read, rows; from ``pg_stat_statements``,
which the private cluster loads; with ``--dsn``, only if the server has it); and,
once the writers are done and the relay stopped (the holder still holding),
``EXPLAIN (ANALYZE, BUFFERS)`` of one call of each statement, rolled back: the
relay's claim (a session's first claim, from the bottom, and the next one, past
what the first found gone) over 1,000 rows due now, and the mover over 200 rows
just due, from ``LOOK_BACK`` before the last row the run moved (a move, as the
relay's during the run) and from the bottom (a sweep): shared buffers hit + read,
and milliseconds.  Nothing lost: every immediate and every due row arrived exactly
once, and the backlog is still in the scheduled table, whole.  Benchmarks print
figures; nothing here is a timed assertion.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import time
import uuid
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from outbox.bench.deadrows import explain_claim
from outbox.bench.harness import (
    BenchTopology,
    Database,
    Echo,
    Receiver,
    RelayProcesses,
    bench_database,
    drop_outbox,
    percentile,
    wait_registered,
)
from outbox.bench.horizon import DRAIN_SECONDS, HorizonOptions, Producer, hold, ratio
from outbox.config import Settings
from outbox.db import migrate, scheduled, session
from outbox.db.batches import BatchStore
from outbox.db.queries import Queries
from outbox.tables import table_identifiers

SHAPES = ("none", "backlog", "due")
# Which shapes run side by side: the control beside the backlog (the ratio between
# them is the figure), then the due shape alone (twice the rows: beside the others
# it would set the load they meet).
PHASES = (("none", "backlog"), ("due",))
HOLDERS = ("none", "snapshot")
# The backlog's first row is due this long after the run's start: none comes due
# during a run, so each figure counts only the rows it names.
BACKLOG_FROM = datetime.timedelta(hours=1)
# Rows per INSERT while writing the backlog (one transaction each).
FILL_CHUNK = 200_000
# The EXPLAIN step: rows due now in the outbox, rows just due in the scheduled table,
# and the claim's batch (the relay's default).
EXPLAIN_ROWS = 1000
EXPLAIN_DUE = 200
EXPLAIN_BATCH = 100
# The private cluster loads pg_stat_statements: the relay's own calls, per call.
STATEMENT_SETTINGS = {"shared_preload_libraries": "pg_stat_statements"}
# Seconds from the writers' being ready to their first commit, and to the first due
# row of the due shape (scheduled meanwhile: 60,000 rows through the trigger).
WRITERS_LEAD = 5.0


@dataclasses.dataclass(frozen=True)
class ScheduledOptions:
    amqp_url: str
    dsn: str | None = None
    scheduled: int = 1_000_000  # rows waiting in the backlog shapes
    days: float = 30.0  # over which the backlog comes due
    rate: float = 1000.0  # immediate rows per second
    due_rate: float = 1000.0  # scheduled rows coming due per second (the due shape)
    seconds: float = 60.0
    rows_per_commit: int = 10
    payload: int = 200
    holders: tuple[str, ...] = HOLDERS


def write_backlog(conn: Any, table: str, exchange: str, o: ScheduledOptions) -> float:
    """``o.scheduled`` rows through the outbox (its trigger diverts them), due from
    ``BACKLOG_FROM`` on over ``o.days``; then VACUUM ANALYZE.  Returns seconds taken."""
    started = time.monotonic()
    step = datetime.timedelta(days=o.days) / max(1, o.scheduled)
    for first in range(0, o.scheduled, FILL_CHUNK):
        last = min(o.scheduled, first + FILL_CHUNK)
        conn.execute(
            sql.SQL(
                "INSERT INTO {outbox} (exchange, routing_key, payload, deliver_at) "
                "SELECT %s, 'bench.later', convert_to(rpad(i::text, %s, 'x'), 'UTF8'), "
                "now() + %s + i * %s FROM generate_series(%s::bigint, %s::bigint) AS i"
            ).format(**table_identifiers(table)),
            [exchange, o.payload, BACKLOG_FROM, step, first, last - 1],
        )
    conn.execute(sql.SQL("VACUUM (ANALYZE) {scheduled}").format(**table_identifiers(table)))
    return time.monotonic() - started


def schedule_due(
    conn: Any, table: str, exchange: str, o: ScheduledOptions, lead: float
) -> dict[str, float]:
    """``o.due_rate`` rows a second for ``o.seconds``, the first due ``lead`` seconds
    from now (through the trigger); returns {message_id: due time, epoch seconds}."""
    ids = table_identifiers(table)
    count = max(1, round(o.due_rate * o.seconds))
    conn.execute(
        sql.SQL(
            "INSERT INTO {outbox} (exchange, routing_key, payload, deliver_at) "
            "SELECT %s, 'bench.due', convert_to(rpad(i::text, %s, 'x'), 'UTF8'), "
            "now() + make_interval(secs => %s + i / %s) "
            "FROM generate_series(0, %s - 1) AS i"
        ).format(**ids),
        [exchange, o.payload, lead, o.due_rate, count],
    )
    rows = conn.execute(
        sql.SQL(
            "SELECT message_id::text AS m, extract(epoch FROM deliver_at)::float8 AS due "
            "FROM {scheduled} WHERE routing_key = 'bench.due'"
        ).format(**ids)
    ).fetchall()
    return {r["m"]: r["due"] for r in rows}


def statement_calls(conn: Any, table: str) -> dict[str, Any] | None:
    """The relay's claims and moves on ``table`` so far, from ``pg_stat_statements``:
    calls, and per call ms, shared buffers hit + read and rows (None: the server
    does not track statements)."""
    try:
        rows = conn.execute(
            "SELECT CASE WHEN strpos(query, 'committed_since') > 0 THEN 'claim' "
            "ELSE 'move' END AS kind, sum(calls)::bigint AS calls, "
            "sum(total_exec_time)::float8 AS ms, "
            "sum(shared_blks_hit + shared_blks_read)::bigint AS buffers, "
            "sum(rows)::bigint AS rows FROM pg_stat_statements "
            "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND strpos(query, %s) > 0 AND (strpos(query, 'committed_since') > 0 "
            "OR strpos(query, 'WITH due AS MATERIALIZED') > 0) GROUP BY 1",
            [f'"{table}"'],
        ).fetchall()
    except psycopg.Error:
        return None
    calls: dict[str, Any] = {"claim": None, "move": None}
    for r in rows:
        n = int(r["calls"])
        calls[r["kind"]] = {
            "calls": n,
            "ms_per_call": round(r["ms"] / n, 3),
            "buffers_per_call": round(r["buffers"] / n, 1),
        }
        if r["kind"] == "claim":  # the mover returns one row: its figures
            calls["claim"]["rows_per_call"] = round(r["rows"] / n, 1)
    return calls


def explain(
    dsn: str, table: str, exchange: str, last_due: datetime.datetime | None
) -> dict[str, Any]:
    """One call of the claim and of the mover under EXPLAIN (ANALYZE, BUFFERS), each
    rolled back: ``EXPLAIN_ROWS`` rows due now, ``EXPLAIN_DUE`` scheduled rows just
    due; the move from ``LOOK_BACK`` before ``last_due`` (the last row the run moved)
    or now (none)."""
    ids = table_identifiers(table)
    conn = session.connect(dsn, application_name="outbox-bench-explain")
    store = BatchStore(dsn, table, statement_timeout=600)
    try:
        conn.execute(
            sql.SQL(
                "INSERT INTO {outbox} (exchange, routing_key, payload) "
                "SELECT %s, 'bench.explain', 'x' FROM generate_series(1, %s)"
            ).format(**ids),
            [exchange, EXPLAIN_ROWS],
        )
        conn.execute(
            sql.SQL(
                "INSERT INTO {outbox} (exchange, routing_key, payload, deliver_at) "
                "SELECT %s, 'bench.explain', 'x', now() + interval '1 second' "
                "FROM generate_series(1, %s)"
            ).format(**ids),
            [exchange, EXPLAIN_DUE],
        )
        claim_first = explain_claim(store, EXPLAIN_BATCH)  # a session's first: the bottom
        store.claim_batch(EXPLAIN_BATCH)
        store.conn.execute("COMMIT")
        claim_next = explain_claim(store, EXPLAIN_BATCH)
        time.sleep(1.2)  # the scheduled rows come due
        queries = Queries(table)
        now = conn.execute("SELECT now() AS now").fetchone()
        assert now is not None
        covered = min(now["now"], last_due) if last_due is not None else now["now"]
        move = explain_move(conn, queries, covered - scheduled.LOOK_BACK)
        sweep = explain_move(conn, queries, scheduled.scan_from(None, sweep=True))
    finally:
        store.close()
        conn.close()
    return {
        "claim_first": _call(claim_first),
        "claim": _call(claim_next),
        "move": _call(move[:2], rows=move[2]),
        "sweep": _call(sweep[:2], rows=sweep[2]),
    }


def explain_move(
    conn: Any, queries: Queries, scan_from: datetime.datetime
) -> tuple[float, int, int]:
    """(ms, shared buffers hit + read, rows moved) of one move from ``scan_from``,
    rolled back."""
    with conn.transaction(force_rollback=True):
        row = conn.execute(
            sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {}").format(queries["move_due"]),
            {"scan_from": scan_from, "limit": scheduled.MOVE_LIMIT},
        ).fetchone()
    assert row is not None
    top = next(iter(row.values()))[0]
    plan = top["Plan"]
    return (
        float(top["Execution Time"]),
        int(plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0)),
        _rows_inserted(plan),
    )


def _rows_inserted(plan: dict[str, Any]) -> int:
    """The rows the plan's INSERT (the CTE ``inserted``) wrote."""
    if plan.get("Operation") == "Insert":
        return int(plan.get("Actual Rows", 0)) or int(plan["Plans"][0].get("Actual Rows", 0))
    return max((_rows_inserted(p) for p in plan.get("Plans", [])), default=0)


def _call(figures: tuple[float, int], **extra: int) -> dict[str, Any]:
    return {"ms": round(figures[0], 3), "buffers": figures[1], **extra}


def latencies(
    sent: dict[str, float], arrived: dict[str, float], shift: float = 0.0
) -> dict[str, Any]:
    """p50/p99/max in ms of arrival (+ ``shift``) minus the time each row was sent
    or due; how many were sent and delivered."""
    values = sorted((arrived[m] + shift - t) * 1000 for m, t in sent.items() if m in arrived)
    return {
        "sent": len(sent),
        "delivered": len(values),
        "p50_ms": round(percentile(values, 50), 2) if values else None,
        "p99_ms": round(percentile(values, 99), 2) if values else None,
        "max_ms": round(values[-1], 2) if values else None,
    }


@dataclasses.dataclass
class Lane:
    """One shape of a run: its own outbox table, queue, relay, writer and consumer."""

    shape: str
    table: str
    broker: BenchTopology
    receiver: Receiver
    backlog: int
    fill_seconds: float | None = None
    relays: RelayProcesses | None = None
    producer: Producer | None = None
    due: dict[str, float] = dataclasses.field(default_factory=dict)
    committed: dict[str, float] = dataclasses.field(default_factory=dict)
    left: int | None = None
    relay_calls: dict[str, Any] | None = None
    explain: dict[str, Any] | None = None

    def wanted(self) -> list[str]:
        return [*self.committed, *self.due]


def scheduled_run(
    db: Database, o: ScheduledOptions, holder: str, shapes: Sequence[str], echo: Echo
) -> list[dict[str, Any]]:
    """``shapes`` side by side, under the same load of the machine, while ``holder``
    holds the horizon: one report per shape."""
    conn = session.connect(db.dsn, application_name="outbox-bench")
    lanes: list[Lane] = []
    try:
        for shape in shapes:
            suffix = uuid.uuid4().hex[:8]
            table = f"outbox_sched_{suffix}"
            migrate.migrate(conn, table)
            broker = BenchTopology(o.amqp_url, suffix)
            backlog = o.scheduled if shape != "none" else 0
            lanes.append(Lane(shape, table, broker, Receiver(o.amqp_url, broker.queue), backlog))
        for lane in lanes:
            if lane.backlog:
                lane.fill_seconds = write_backlog(conn, lane.table, lane.broker.exchange, o)
                echo(
                    f"  {holder}/{lane.shape}: {lane.backlog:,} rows scheduled in "
                    f"{lane.fill_seconds:.0f} s"
                )
        # The backlog's writes are flushed before the run: what the run measures is
        # the backlog waiting, not the checkpoint that writing it would bring.
        with contextlib.suppress(psycopg.Error):
            conn.execute("CHECKPOINT")
        for lane in lanes:
            lane.receiver.start()
            lane.receiver.ready.wait(10)
            settings = Settings(
                dsn=db.dsn, amqp_url=o.amqp_url, table=lane.table, ledger_queue=lane.broker.ledger
            )
            lane.relays = RelayProcesses(settings, 1)
        for lane in lanes:
            assert lane.relays is not None
            wait_registered(conn, lane.table, 1, lane.relays)
        with hold(
            holder, db.dsn, lanes[0].table, uuid.uuid4().hex[:8], private=o.dsn is None
        ) as cannot:
            if cannot:
                echo(f"  {holder}: skipped, {cannot}")
                return [
                    {"holder": holder, "shape": lane.shape, "skipped": cannot} for lane in lanes
                ]
            writers = HorizonOptions(
                amqp_url=o.amqp_url, rows_per_commit=o.rows_per_commit, payload=o.payload
            )
            for lane in lanes:
                lane.producer = Producer(
                    db.dsn,
                    lane.table,
                    lane.broker.exchange,
                    writers,
                    rate=o.rate,
                    seconds=o.seconds,
                )
            for lane in lanes:  # all started, however long spawning takes on a loaded machine
                assert lane.producer is not None
                lane.producer.ready()
            # The receivers note perf_counter; due times are the wall clock's.
            wall_shift = time.time() - time.perf_counter()
            begin = time.perf_counter() + WRITERS_LEAD
            for lane in lanes:
                if lane.shape == "due":  # the writers begin when the first row is due
                    lane.due = schedule_due(conn, lane.table, lane.broker.exchange, o, WRITERS_LEAD)
                    begin = min(lane.due.values()) - wall_shift
            for lane in lanes:
                assert lane.producer is not None
                lane.producer.begin(max(begin, time.perf_counter()))
            until = max(lane.producer.until for lane in lanes if lane.producer is not None)
            time.sleep(max(0.0, until - time.perf_counter()))
            for lane in lanes:
                assert lane.producer is not None
                lane.committed = lane.producer.result()
            deadline = time.monotonic() + DRAIN_SECONDS
            for lane in lanes:
                assert lane.relays is not None
                while time.monotonic() < deadline and not all(
                    m in lane.receiver.arrived for m in lane.wanted()
                ):
                    lane.relays.check_alive()
                    time.sleep(0.2)
            for lane in lanes:
                assert lane.relays is not None
                lane.relays.stop()
                lane.relays = None
                left = conn.execute(
                    sql.SQL("SELECT count(*) AS n FROM {scheduled}").format(
                        **table_identifiers(lane.table)
                    )
                ).fetchone()
                lane.left = int(left["n"]) if left else None
                lane.relay_calls = statement_calls(conn, lane.table)
                last_due = (
                    datetime.datetime.fromtimestamp(max(lane.due.values()), datetime.timezone.utc)
                    if lane.due
                    else None
                )
                lane.explain = explain(db.dsn, lane.table, lane.broker.exchange, last_due)
    finally:
        for lane in lanes:
            if lane.relays is not None:
                lane.relays.stop()
            if lane.receiver.ident is not None:  # started
                lane.receiver.stop()
            lane.broker.delete()
            drop_outbox(conn, lane.table)
        conn.close()
    echo(f"  {holder}: done")
    return [
        {
            "holder": holder,
            "shape": lane.shape,
            "skipped": None,
            "scheduled": lane.backlog,
            "fill_seconds": round(lane.fill_seconds, 1) if lane.fill_seconds is not None else None,
            "immediate": latencies(lane.committed, lane.receiver.arrived),
            "due": latencies(lane.due, lane.receiver.arrived, wall_shift) if lane.due else None,
            "duplicates": lane.receiver.duplicates,
            "scheduled_left": lane.left,
            "relay_calls": lane.relay_calls,
            "explain": lane.explain,
        }
        for lane in lanes
    ]


def run_scheduled_bench(o: ScheduledOptions, echo: Echo) -> dict[str, Any]:
    """Every holder's runs, one per phase (``PHASES``)."""
    runs = []
    with bench_database(o.dsn, echo, server_settings=STATEMENT_SETTINGS) as db:
        if o.dsn is None:
            with session.connect(db.dsn, application_name="outbox-bench") as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        for holder in o.holders:
            for shapes in PHASES:
                echo(f"  {holder}: {' and '.join(shapes)}, {o.seconds:.0f} s ...")
                runs += scheduled_run(db, o, holder, shapes, echo)
    beside_control = next(shapes for shapes in PHASES if "none" in shapes)
    for run in runs:
        control = next(
            (
                r
                for r in runs
                if r["holder"] == run["holder"] and r["shape"] == "none" and not r["skipped"]
            ),
            None,
        )
        if run["skipped"] or control is None or run["shape"] not in beside_control:
            continue  # a ratio to the control only for a run beside it
        for q in ("p50", "p99"):
            run[f"{q}_to_control"] = ratio(
                run["immediate"][f"{q}_ms"], control["immediate"][f"{q}_ms"]
            )
    done = [r for r in runs if not r["skipped"]]
    return {
        "postgres": db.description,
        "scheduled": o.scheduled,
        "days": o.days,
        "rate": o.rate,
        "due_rate": o.due_rate,
        "seconds": o.seconds,
        "rows_per_commit": o.rows_per_commit,
        "payload_bytes": o.payload,
        "runs": runs,
        "nothing_lost": bool(done)
        and all(
            r["immediate"]["delivered"] == r["immediate"]["sent"]
            and (r["due"] is None or r["due"]["delivered"] == r["due"]["sent"])
            and r["duplicates"] == 0
            and r["scheduled_left"] == r["scheduled"]
            for r in done
        ),
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _per_call(c: dict[str, Any] | None) -> list[str]:
    if c is None:
        return ["-"] * 3
    return [f"{c['calls']:,}", f"{c['ms_per_call']:.3f}", f"{c['buffers_per_call']:,.1f}"]


def render(report: dict[str, Any]) -> str:
    lines = [
        f"outbox bench --scheduled: {report['rate']:,.0f} rows/s due now in "
        f"{report['rows_per_commit']}-row transactions of {report['payload_bytes']} B "
        f"payloads for {report['seconds']:.0f} s; backlog: {report['scheduled']:,} rows "
        f"due over {report['days']:g} days from an hour on; due shape: "
        f"{report['due_rate']:,.0f} rows/s coming due; none and backlog side by side, "
        "then due alone, a relay each, default settings; "
        f"PostgreSQL: {report['postgres']}",
        "",
        "| held | shape | immediate p50 | p99 | p50 / p99 vs nothing scheduled | "
        "due → delivery p50 | p99 | max |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in report["runs"]:
        if run["skipped"]:
            lines.append(
                f"| {run['holder']} | {run['shape']} | skipped: {run['skipped']} | | | | | |"
            )
            continue
        imm, due = run["immediate"], run["due"] or {}
        lines.append(
            f"| {run['holder']} | {run['shape']} | {_ms(imm['p50_ms'])} ms | "
            f"{_ms(imm['p99_ms'])} ms | {_x(run.get('p50_to_control'))} / "
            f"{_x(run.get('p99_to_control'))} | {_ms(due.get('p50_ms'))} ms | "
            f"{_ms(due.get('p99_ms'))} ms | {_ms(due.get('max_ms'))} ms |"
        )
    lines += [
        "",
        "the relay's own calls during the run (pg_stat_statements): calls; per call: "
        "ms, shared buffers hit + read (and the claim's rows: its batch and its front)",
        "",
        "| held | shape | claims | claim: ms | buffers | rows | moves | move: ms | buffers |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in report["runs"]:
        if run["skipped"]:
            continue
        calls = run["relay_calls"] or {}
        claim, move = calls.get("claim"), calls.get("move")
        cells = _per_call(claim) + ([f"{claim['rows_per_call']:,.1f}"] if claim else ["-"])
        cells += _per_call(move)
        lines.append(f"| {run['holder']} | {run['shape']} | {' | '.join(cells)} |")
    lines += [
        "",
        "one call each, EXPLAIN (ANALYZE, BUFFERS), rolled back, after the run (the holder "
        f"still holding): the claim of {EXPLAIN_BATCH} of {EXPLAIN_ROWS} rows due now (a "
        f"session's first, then the next), the mover of {EXPLAIN_DUE} rows just due (a "
        "move, from LOOK_BACK before the last row the run moved; a sweep, from the bottom): "
        "shared buffers, ms",
        "",
        "| held | shape | claim, first | claim | move | sweep |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for run in report["runs"]:
        if run["skipped"]:
            continue
        e = run["explain"]
        each = " | ".join(
            f"{e[k]['buffers']:,} buf, {e[k]['ms']:.2f} ms"
            for k in ("claim_first", "claim", "move", "sweep")
        )
        lines.append(f"| {run['holder']} | {run['shape']} | {each} |")
    lines += [
        "",
        "nothing lost: every row due now and every row come due arrived exactly once, "
        "the backlog is whole"
        if report["nothing_lost"]
        else "ROWS MISSING (or duplicated, or the backlog changed)",
    ]
    return "\n".join(lines)
