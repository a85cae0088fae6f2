"""Draining a backlog behind dead rows, against the same backlog on a fresh table (issue 33).

``python -m outbox.bench.drain [--dead 1000000] [--rows 80000] [--repeats 3]``

One private PostgreSQL cluster (fsync on) and one bench topology on the broker.
First, on the fresh table, one relay with default settings drains a backlog of
``--rows`` rows of ``--payload`` bytes (``Bench.relay``, as ``outbox bench``'s
throughput run), ``--repeats`` times.  Then a REPEATABLE READ snapshot of the
outbox is taken and held (as ``pg_dump`` holds one), ``--dead`` rows are inserted
and deleted behind it, and the same backlog is drained again ``--repeats`` times,
with the snapshot still held: every row drained on the way joins the dead ones.
Printed: msg/s of each run, the medians, and their ratio (the issue's target:
≥ 0.9).  A benchmark prints figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import uuid
from typing import Any

from outbox.bench.harness import Bench, BenchOptions, BenchTopology, bench_database
from outbox.config import DEFAULT_AMQP_URL
from outbox.db import session


def _dead_rows(dsn: str, table: str, count: int) -> int:
    """Insert ``count`` rows into the drained (empty) outbox and delete them; returns
    the table's dead tuples after (the statistics' figure)."""
    with session.connect(dsn, application_name="outbox-bench-dead") as conn:
        chunk = 200_000
        for start in range(0, count, chunk):
            conn.execute(
                f'INSERT INTO "{table}" (exchange, routing_key, payload) '
                "SELECT 'x', 'k', convert_to(repeat('p', 200), 'UTF8') "
                "FROM generate_series(1, %s)",
                [min(chunk, count - start)],
            )
        conn.execute(f'DELETE FROM "{table}"')
        conn.execute("SELECT pg_stat_force_next_flush()")
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT n_dead_tup AS n FROM pg_stat_user_tables WHERE relname = %s", [table]
        ).fetchone()
    return int(row["n"]) if row else 0


def measure(options: BenchOptions, dead: int, repeats: int, echo: Any) -> dict[str, Any]:
    suffix = uuid.uuid4().hex[:8]
    with bench_database(options.dsn, echo) as db:
        broker = BenchTopology(options.amqp_url, suffix)
        bench = Bench(options, db, broker, echo)
        try:
            fresh = []
            for i in range(repeats):
                fresh.append(bench.relay(1).rate)
                echo(f"  fresh table        run {i + 1}: {fresh[-1]:,.0f} msg/s")
            with session.connect(db.dsn, application_name="outbox-bench-holder") as holder:
                holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                holder.execute(f'SELECT count(*) FROM "{db.table}"')
                echo(f"  snapshot held; {dead:,} rows inserted and deleted behind it ...")
                dead_tuples = _dead_rows(db.dsn, db.table, dead)
                behind = []
                for i in range(repeats):
                    behind.append(bench.relay(1).rate)
                    echo(f"  behind dead rows   run {i + 1}: {behind[-1]:,.0f} msg/s")
                holder.execute("ROLLBACK")
        finally:
            bench.close()
            broker.delete()
    fresh_rate, behind_rate = statistics.median(fresh), statistics.median(behind)
    return {
        "rows": options.rows,
        "dead": dead,
        "dead_tuples_before_draining": dead_tuples,
        "fresh_msg_per_s": fresh,
        "behind_msg_per_s": behind,
        "ratio": behind_rate / fresh_rate if fresh_rate else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m outbox.bench.drain", description=__doc__)
    parser.add_argument("--dead", type=int, default=1_000_000)
    parser.add_argument("--rows", type=int, default=80_000)
    parser.add_argument("--payload", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--amqp-url", default=DEFAULT_AMQP_URL)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    options = BenchOptions(amqp_url=args.amqp_url, rows=args.rows, payload=args.payload)

    def echo(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    report = measure(options, args.dead, args.repeats, echo)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    fresh, behind = report["fresh_msg_per_s"], report["behind_msg_per_s"]
    print(f"One relay draining {args.rows:,} rows of {args.payload} B (medians of {args.repeats}):")
    print("| table | msg/s | the runs |")
    print("|---|---:|---|")
    print(f"| fresh | {statistics.median(fresh):,.0f} | {' / '.join(f'{r:,.0f}' for r in fresh)} |")
    print(
        f"| behind {args.dead:,} dead rows ({report['dead_tuples_before_draining']:,} dead "
        f"tuples counted), snapshot held | {statistics.median(behind):,.0f} | "
        f"{' / '.join(f'{r:,.0f}' for r in behind)} |"
    )
    print(f"ratio behind / fresh: {report['ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
