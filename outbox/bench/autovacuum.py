"""What the outbox table's own autovacuum parameters are worth (issue 33).

``python -m outbox.bench.autovacuum [--backlog 1000000] [--drained 100000] [--wait 90]``

``outbox init`` sets the outbox table's autovacuum parameters (schema 0001): a vacuum
after 5,000 dead rows whatever the table's size, where the server's default waits
for 50 + 20% of the table's rows.  Steady churn does not tell them apart (``outbox
bench --horizon --table-autovacuum outbox|server``: autovacuum visits the outbox at
every ``autovacuum_naptime`` either way, the live table being small).  A backlog
does: once the table has held a million rows, the default waits for 200,000 of them
to be dead.

One private PostgreSQL cluster (fsync on, the server's autovacuum settings), two
outbox tables: one as ``outbox init`` leaves it, one with those parameters reset.
Each gets ``--backlog`` rows of 200 B (then VACUUM ANALYZE: the statistics of a table
that has held that backlog for a while), then the ``--drained`` oldest are deleted,
as a relay draining the backlog deletes them.  For ``--wait`` seconds it samples each
table's dead rows and autovacuum runs.  Prints the samples; a benchmark, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from outbox.bench.horizon import table_autovacuum
from outbox.db import migrate, session
from outbox.db.devcluster import PostgresCluster

TABLES = {"outbox_own": "outbox", "outbox_server": "server"}


def _sample(conn: Any, table: str) -> dict[str, Any]:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT n_dead_tup AS dead, n_live_tup AS live, autovacuum_count AS vacuums, "
        "pg_table_size(relid) AS bytes FROM pg_stat_user_tables WHERE relname = %s",
        [table],
    ).fetchone()
    return dict(row) if row else {}


def measure(backlog: int, drained: int, wait: float, echo: Any) -> dict[str, Any]:
    echo("starting a private PostgreSQL (fsync on, the server's autovacuum settings) ...")
    with PostgresCluster(durable=True) as cluster:
        conn = session.connect(cluster.dsn, application_name="outbox-bench")
        for table, choice in TABLES.items():
            migrate.migrate(conn, table)
            table_autovacuum(conn, table, choice)
            conn.execute(
                f'INSERT INTO "{table}" (exchange, routing_key, payload) '
                "SELECT 'x', 'k', convert_to(repeat('p', 200), 'UTF8') "
                "FROM generate_series(1, %s)",
                [backlog],
            )
            # Vacuumed and analyzed: the statistics of a table that has held the
            # backlog for a while (and no insert count left to trigger a vacuum).
            conn.execute(f'VACUUM (ANALYZE) "{table}"')
            echo(f"  {table}: {backlog:,} rows, vacuumed and analyzed")
        for table in TABLES:
            conn.execute(
                f'DELETE FROM "{table}" WHERE id <= (SELECT min(id) FROM "{table}") + %s - 1',
                [drained],
            )
        conn.execute("SELECT pg_stat_force_next_flush()")
        started = time.monotonic()
        samples: list[dict[str, Any]] = []
        while True:
            at = time.monotonic() - started
            row: dict[str, Any] = {"seconds": round(at)}
            for table in TABLES:
                row[table] = _sample(conn, table)
            samples.append(row)
            echo(
                f"  {at:4.0f} s: "
                + "; ".join(
                    f"{t} {row[t].get('dead', 0):,} dead, {row[t].get('vacuums', 0)} autovacuums"
                    for t in TABLES
                )
            )
            if at >= wait:
                break
            time.sleep(min(5.0, wait - at))
        conn.close()
    return {"backlog": backlog, "drained": drained, "wait_seconds": wait, "samples": samples}


def render(report: dict[str, Any]) -> str:
    last = report["samples"][-1]
    lines = [
        f"python -m outbox.bench.autovacuum: a backlog of {report['backlog']:,} rows "
        f"(vacuumed and analyzed), its {report['drained']:,} oldest deleted, then "
        f"{report['wait_seconds']:.0f} s; private cluster, fsync on",
        "",
        "| table | autovacuum parameters | dead rows at the end | autovacuum runs | table |",
        "|---|---|---:|---:|---:|",
    ]
    for table, choice in TABLES.items():
        s = last[table]
        what = "the table's own (outbox init)" if choice == "outbox" else "the server's defaults"
        lines.append(
            f"| {table} | {what} | {s.get('dead', 0):,} | {s.get('vacuums', 0)} | "
            f"{(s.get('bytes') or 0) / 1048576:.1f} MiB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m outbox.bench.autovacuum", description=__doc__)
    parser.add_argument("--backlog", type=int, default=1_000_000)
    parser.add_argument("--drained", type=int, default=100_000)
    parser.add_argument("--wait", type=float, default=90.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    def echo(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    report = measure(args.backlog, args.drained, args.wait, echo)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
