"""What idle databases cost: one fleet process with a thread per database, against a
relay process per database (the measurement behind ``outbox.fleet.process``'s design).

``python -m outbox.fleet.footprint [--databases 50] [--seconds 60] [--amqp-url URL]``
starts a private PostgreSQL cluster, creates that many databases with the outbox
table, and runs, one after the other, with nothing to relay:

- ``fleet``: ``outbox relay --targets FILE`` (dormant after 5 s);
- ``fleet-awake``: the same with ``--dormant-after 0`` (every target fully open);
- ``processes``: one ``outbox relay --dsn`` per database (the single-database default).

For each: the PostgreSQL sessions the relays hold (``pg_stat_activity``), their
resident memory (``VmRSS``, summed over the processes), and their CPU time over
``--seconds`` once settled, as a share of one core.  Prints one line per run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence

import psycopg
from psycopg import sql

from outbox.db import migrate
from outbox.db.devcluster import PostgresCluster

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def relay_sessions(server_dsn: str) -> int:
    with psycopg.connect(server_dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'outbox-relay%'"
        ).fetchone()
    return int(row[0]) if row else 0


@contextlib.contextmanager
def running(commands: Sequence[Sequence[str]], env: dict[str, str]) -> Iterator[list[int]]:
    procs = [
        subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for c in commands
    ]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


def settle(server_dsn: str, sessions: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while relay_sessions(server_dsn) != sessions:
        if time.monotonic() > deadline:
            raise SystemExit(
                f"the relays hold {relay_sessions(server_dsn)} sessions, not {sessions}"
            )
        time.sleep(1.0)


def measure(
    name: str,
    commands: Sequence[Sequence[str]],
    env: dict[str, str],
    server_dsn: str,
    sessions: int,
    seconds: float,
) -> str:
    with running(commands, env) as pids:
        settle(server_dsn, sessions)
        time.sleep(2.0)
        before = sum(cpu_seconds(p) for p in pids)
        time.sleep(seconds)
        cpu = sum(cpu_seconds(p) for p in pids) - before
        rss = sum(rss_kib(p) for p in pids) / 1024
        held = relay_sessions(server_dsn)
    return (
        f"{name}: {len(pids)} process(es), {held} PostgreSQL sessions, "
        f"RSS {rss:.0f} MiB, CPU {100 * cpu / seconds:.2f}% of a core over {seconds:g} s"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m outbox.fleet.footprint")
    parser.add_argument("--databases", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--amqp-url", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    parser.add_argument("--only", choices=["fleet", "fleet-awake", "processes"], nargs="*")
    args = parser.parse_args(argv)
    n = args.databases
    cluster = PostgresCluster(
        durable=False, extra_settings={"max_connections": str(max(200, 4 * n + 20))}
    )
    server = cluster.start()
    try:
        dsns = []
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute("CREATE DATABASE footprint_template")
        with psycopg.connect(
            psycopg.conninfo.make_conninfo(server, dbname="footprint_template"), autocommit=True
        ) as conn:
            migrate.migrate(conn, "outbox")
        with psycopg.connect(server, autocommit=True) as conn:
            for i in range(n):
                name = f"footprint_{i:03d}"
                conn.execute(
                    sql.SQL("CREATE DATABASE {} TEMPLATE footprint_template").format(
                        sql.Identifier(name)
                    )
                )
                dsns.append(psycopg.conninfo.make_conninfo(server, dbname=name))
        with tempfile.NamedTemporaryFile("w", suffix=".targets", delete=False) as targets:
            targets.write("".join(f"{d}\n" for d in dsns))
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env["OUTBOX_AMQP_URL"] = args.amqp_url
        relay = [sys.executable, "-m", "outbox", "relay"]
        runs = {
            "fleet": (
                [[*relay, "--targets", targets.name, "--dormant-after", "5"]],
                n,
            ),
            "fleet-awake": (
                [[*relay, "--targets", targets.name, "--dormant-after", "0"]],
                3 * n,
            ),
            "processes": ([[*relay, "--dsn", d] for d in dsns], 3 * n),
        }
        for name, (commands, sessions) in runs.items():
            if args.only and name not in args.only:
                continue
            print(measure(name, commands, env, server, sessions, args.seconds), flush=True)
        os.unlink(targets.name)
    finally:
        cluster.destroy()


if __name__ == "__main__":
    main()
