"""``outbox bench --commits``: what the wake-up trigger costs the applications' commits.

A transaction that ran NOTIFY holds a database-wide lock from COMMIT until its
commit record is flushed, so commits that notify cannot share a WAL flush: they
are at most one per flush, whatever the number of clients.  Since schema 5 the
outbox trigger notifies only while a relay waits (``outbox.db.relays.WakeupListener``).

pgbench (the server's own load generator, so that the client costs next to
nothing) commits single-row INSERT transactions into the outbox from 16 clients,
as fast as they go, under four triggers, runs alternated:

- ``none``: the trigger disabled (the floor);
- ``schema 4``: the unconditional NOTIFY of schema 4 (its function body, put back
  for the run);
- ``schema 5, relays busy``: the current trigger while no relay waits;
- ``schema 5, a relay waiting``: the current trigger while a session holds the
  wake-up lock, as an idle relay does.

Each twice: as the disk is, and with a 1 ms flush simulated (``commit_delay =
1000`` µs, a superuser setting: skipped, saying so, where the role may not set it).
Reported: commits/s and the mean commit latency pgbench saw, medians of
``repeats``.  Figures only; nothing here is a timed assertion.
"""

from __future__ import annotations

import dataclasses
import os
import re
import statistics
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql

from outbox.bench.harness import Database, Echo, bench_database
from outbox.db import migrate, session
from outbox.db.devcluster import postgres_bindir
from outbox.db.relays import WakeupListener
from outbox.errors import OutboxError
from outbox.tables import table_identifiers

CLIENTS = 16
FLUSH_DELAYS_US = (0, 1000)
TRIGGERS = ("none", "schema 4", "schema 5, relays busy", "schema 5, a relay waiting")


def schema_4_function() -> str:
    """The outbox trigger's function as schemas 1 to 4 had it (``0001_outbox.sql``)."""
    [first] = [m for m in migrate.migrations() if m.version == 1]
    match = re.search(
        r"^CREATE OR REPLACE FUNCTION \{notify_function\}\(\).*?^\$\$;", first.text, re.M | re.S
    )
    assert match, "0001_outbox.sql defines the trigger's function"
    return match.group(0).rstrip(";")


@dataclasses.dataclass(frozen=True)
class CommitsOptions:
    dsn: str | None
    transactions: int = 20_000
    payload: int = 1024
    repeats: int = 3


@dataclasses.dataclass(frozen=True)
class PgbenchRun:
    commits_per_s: float
    latency_ms: float


def run_commits_bench(options: CommitsOptions, echo: Echo) -> dict[str, Any]:
    pgbench = os.path.join(postgres_bindir(), "pgbench")
    if not os.path.exists(pgbench):
        raise OutboxError(
            f"pgbench not found next to the server's binaries ({pgbench})",
            "install the PostgreSQL server package, which ships it",
        )
    with bench_database(options.dsn, echo) as db:
        return _measure(pgbench, db, options, echo)


def _measure(pgbench: str, db: Database, o: CommitsOptions, echo: Echo) -> dict[str, Any]:
    ids = table_identifiers(db.table)
    conn = session.connect(db.dsn, application_name="outbox-bench")
    try:
        current_body = conn.execute(
            "SELECT pg_get_functiondef(%s::regprocedure) AS body",
            [sql.Identifier(f"{db.table}_notify").as_string(conn) + "()"],
        ).fetchone()
        assert current_body is not None
        delays = [d for d in FLUSH_DELAYS_US if d == 0 or _may_set_commit_delay(conn)]
        if len(delays) < len(FLUSH_DELAYS_US):
            echo("commit_delay needs a superuser: the simulated 1 ms flush is skipped")
        script = _script(db.table, o.payload)
        runs: dict[tuple[int, str], list[PgbenchRun]] = {
            (d, t): [] for d in delays for t in TRIGGERS
        }
        for repeat in range(o.repeats):
            for delay in delays:
                for trigger in TRIGGERS:
                    with _trigger(conn, db, ids, trigger, current_body["body"]):
                        run = _pgbench(pgbench, db.dsn, script, o.transactions, delay)
                    conn.execute(sql.SQL("TRUNCATE {}").format(ids["outbox"]))
                    runs[(delay, trigger)].append(run)
                    echo(
                        f"  flush delay {delay:>4} µs, {trigger:<26} run {repeat + 1}: "
                        f"{run.commits_per_s:,.0f} commits/s, {run.latency_ms:.2f} ms"
                    )
        restored = _trigger_state(conn, db.table) == (current_body["body"], "O")
    finally:
        conn.close()
        os.unlink(script)
    return {
        "clients": CLIENTS,
        "transactions": o.transactions,
        "payload": o.payload,
        "repeats": o.repeats,
        "database": db.description,
        "trigger_restored": restored,
        "cells": [
            {
                "flush_delay_us": delay,
                "trigger": trigger,
                "commits_per_s": round(statistics.median(r.commits_per_s for r in cell)),
                "latency_ms": round(statistics.median(r.latency_ms for r in cell), 2),
                "runs": [round(r.commits_per_s) for r in cell],
            }
            for (delay, trigger), cell in runs.items()
        ],
    }


def render(report: dict[str, Any]) -> str:
    lines = [
        f"outbox bench --commits: {report['transactions']} single-row INSERT transactions "
        f"of {report['payload']} B from {report['clients']} pgbench clients, "
        f"{report['database']}, medians of {report['repeats']}",
        "",
        "| flush delay | trigger | commits/s | mean commit ms | the runs |",
        "|---:|---|---:|---:|---|",
    ]
    for c in report["cells"]:
        runs = " / ".join(f"{r:,}" for r in c["runs"])
        lines.append(
            f"| {c['flush_delay_us']} µs | {c['trigger']} | {c['commits_per_s']:,} "
            f"| {c['latency_ms']:.2f} | {runs} |"
        )
    return "\n".join(lines)


def _script(table: str, payload: int) -> str:
    fd, path = tempfile.mkstemp(prefix="outbox-bench-", suffix=".sql")
    with os.fdopen(fd, "w") as f:
        f.write(
            f'INSERT INTO "{table}" (exchange, routing_key, payload) '
            f"VALUES ('', 'bench.commits', convert_to(repeat('x', {payload}), 'SQL_ASCII'));\n"
        )
    os.chmod(path, 0o644)  # readable by pgbench run as another user
    return path


def _trigger_state(conn: session.Conn, table: str) -> tuple[str, str]:
    """The trigger function's definition and whether the trigger fires (``O``)."""
    row = conn.execute(
        "SELECT pg_get_functiondef(t.tgfoid) AS body, t.tgenabled AS enabled"
        " FROM pg_trigger t WHERE t.tgrelid = %s::regclass AND t.tgname = %s",
        [sql.Identifier(table).as_string(conn), f"{table}_notify"],
    ).fetchone()
    assert row is not None
    return row["body"], row["enabled"]


def _may_set_commit_delay(conn: session.Conn) -> bool:
    try:
        with conn.transaction():
            conn.execute("SET LOCAL commit_delay = 1000")
    except psycopg.Error:
        return False
    return True


@contextmanager
def _trigger(
    conn: session.Conn, db: Database, ids: dict[str, Any], trigger: str, current: str
) -> Iterator[None]:
    """The outbox's trigger as ``trigger`` says, for one run; put back afterwards."""
    waiting: WakeupListener | None = None
    if trigger == "none":
        conn.execute(
            sql.SQL("ALTER TABLE {} DISABLE TRIGGER {}").format(
                ids["outbox"], ids["notify_trigger"]
            )
        )
    elif trigger == "schema 4":
        conn.execute(sql.SQL(schema_4_function()).format(**ids))
    elif trigger == "schema 5, a relay waiting":
        waiting = WakeupListener(db.dsn, db.table)
        waiting.want_wakeups()
    try:
        yield
    finally:
        if waiting is not None:
            waiting.close()
        conn.execute(
            sql.SQL("ALTER TABLE {} ENABLE TRIGGER {}").format(ids["outbox"], ids["notify_trigger"])
        )
        conn.execute(current)


def _pgbench(pgbench: str, dsn: str, script: str, transactions: int, delay: int) -> PgbenchRun:
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    env = dict(os.environ)
    for key, var in (
        ("host", "PGHOST"),
        ("port", "PGPORT"),
        ("user", "PGUSER"),
        ("password", "PGPASSWORD"),
        ("dbname", "PGDATABASE"),
    ):
        if info.get(key) is not None:
            env[var] = str(info[key])
    if delay:
        env["PGOPTIONS"] = f"-c commit_delay={delay} -c commit_siblings=1"
    per_client = max(1, transactions // CLIENTS)
    command = [pgbench, "-n", "-M", "prepared", "-c", str(CLIENTS), "-j", "2"]
    command += ["-t", str(per_client), "-f", script]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    tps = re.search(r"^tps = ([0-9.]+)", done.stdout, re.M)
    latency = re.search(r"^latency average = ([0-9.]+) ms", done.stdout, re.M)
    if done.returncode != 0 or not tps or not latency:
        raise OutboxError(
            f"pgbench failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}"
        )
    return PgbenchRun(float(tps.group(1)), float(latency.group(1)))
