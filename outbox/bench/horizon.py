"""``outbox bench --horizon``: the relay while something holds the MVCC horizon.

Every row the relay deletes stays in the table as a dead tuple until no snapshot
can see it (DESIGN, "Facts for the MVCC horizon").  Here an application commits at
a fixed rate (``rate`` rows/s in transactions of ``rows_per_commit`` rows with
``payload``-byte payloads: 1,000 rows/s, 10 rows, 200 B as issue 33 measured) to a
fresh outbox table while one relay with default settings runs, for ``seconds``,
once per holder of the horizon:

- ``none``: nothing held (the control run);
- ``snapshot``: a REPEATABLE READ transaction that read the outbox, keeping its
  ACCESS SHARE lock to the end, as ``pg_dump`` or a report does;
- ``untouched``: a REPEATABLE READ transaction that never touched the outbox
  (same horizon, no lock: what a rotating design can and cannot live with);
- ``logical-slot``: a logical replication slot (``test_decoding``; needs
  ``wal_level = logical``, which the private cluster has).  It holds only
  ``catalog_xmin``: the system catalogs' dead rows, not the outbox's;
- ``prepared``: another application's prepared transaction.

Per window of ``window_seconds`` (by commit time): commit → delivery latency
p50/p99 (the consumer's clock and the producers' are the same machine's
CLOCK_MONOTONIC), claims and the claim's mean time (the relay's own
``outbox_claim_duration_seconds`` histogram, scraped from its metrics endpoint),
the relay's and its PostgreSQL backends' CPU per claim (``/proc``), the outbox's
dead rows (``pg_stat_user_tables.n_dead_tup``) and its size with indexes; and at
the end what ``outbox status`` names as the horizon's holder.  Benchmarks print
figures; nothing here is a timed assertion.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import multiprocessing
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from psycopg import pq

from outbox.bench.harness import (
    PRODUCER_START_SECONDS,
    Backends,
    BenchTopology,
    Database,
    Echo,
    Receiver,
    RelayProcesses,
    bench_database,
    percentile,
    wait_registered,
)
from outbox.config import Settings
from outbox.db import migrate, session
from outbox.db.devcluster import free_port
from outbox.db.horizon import Horizon, HorizonReader
from outbox.errors import OutboxError

HOLDERS = ("none", "snapshot", "untouched", "logical-slot", "prepared")
DEFAULT_HOLDERS = "none,snapshot,untouched,logical-slot"

# The private cluster can host a logical slot; everything else is the bench's default.
LOGICAL_SETTINGS = {"wal_level": "logical", "max_replication_slots": "8", "max_wal_senders": "8"}

# After the writers stop, how long the bench waits for the last messages.
DRAIN_SECONDS = 120.0


@dataclasses.dataclass(frozen=True)
class HorizonOptions:
    amqp_url: str
    dsn: str | None = None
    holders: tuple[str, ...] = tuple(DEFAULT_HOLDERS.split(","))
    seconds: float = 240.0
    window_seconds: float = 60.0
    rate: float = 1000.0  # rows per second
    rows_per_commit: int = 10
    payload: int = 200


def parse_holders(text: str) -> tuple[str, ...]:
    holders = tuple(h.strip() for h in text.split(",") if h.strip())
    unknown = [h for h in holders if h not in HOLDERS]
    if unknown or not holders:
        raise ValueError(f"not a list of {', '.join(HOLDERS)}: {text!r}")
    return holders


# -- the application: fixed-rate commits in a process of its own ----------------------
def commit_batches(
    dsn: str,
    table: str,
    exchange: str,
    payload: int,
    rows_per_commit: int,
    commits_per_s: float,
    until: float,
    start: float,
    results: Any,
) -> None:
    """Commit ``rows_per_commit`` rows at ``start + i / commits_per_s`` until ``until``
    (``time.perf_counter``); puts {message_id: when its COMMIT returned} on ``results``
    (or the error, as text).  One libpq call per transaction (the INSERT in
    autocommit), as ``harness.commit_rows`` does: the producer stands for an
    application elsewhere and must cost the relay it measures little."""
    committed: dict[str, float] = {}
    try:
        with session.connect(dsn, application_name="outbox-bench-producer") as producer:
            pgconn = producer.pgconn
            prepared = pgconn.prepare(
                b"bench_commit",
                f'INSERT INTO "{table}" (message_id, exchange, routing_key, payload) '
                "SELECT m, $2, 'bench.horizon', $3::bytea FROM unnest($1::uuid[]) AS m".encode(),
            )
            if prepared.status != pq.ExecStatus.COMMAND_OK:
                raise OutboxError(prepared.get_error_message())
            params = [b"", exchange.encode(), b"x" * payload]
            formats = [pq.Format.TEXT, pq.Format.TEXT, pq.Format.BINARY]
            i = 0
            while True:
                due = start + i / commits_per_s
                if due >= until:
                    break
                pause = due - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                ids = [str(uuid.uuid4()) for _ in range(rows_per_commit)]
                params[0] = ("{" + ",".join(ids) + "}").encode()
                result = pgconn.exec_prepared(b"bench_commit", params, formats)
                if result.status != pq.ExecStatus.COMMAND_OK:
                    raise OutboxError(result.get_error_message())
                now = time.perf_counter()
                for message_id in ids:
                    committed[message_id] = now
                i += 1
    except Exception as exc:
        results.put(f"{type(exc).__name__}: {exc}")
        return
    results.put(committed)


class Producer:
    """``commit_batches`` in a spawned process (no fork of a threaded process)."""

    def __init__(self, dsn: str, table: str, exchange: str, o: HorizonOptions) -> None:
        context = multiprocessing.get_context("spawn")
        self._results = context.Queue()
        self.start = time.perf_counter() + PRODUCER_START_SECONDS
        self.until = self.start + o.seconds
        self._process = context.Process(
            target=commit_batches,
            args=(
                dsn,
                table,
                exchange,
                o.payload,
                o.rows_per_commit,
                o.rate / o.rows_per_commit,
                self.until,
                self.start,
                self._results,
            ),
            daemon=True,
        )
        self._process.start()

    def result(self) -> dict[str, float]:
        try:
            outcome = self._results.get(timeout=PRODUCER_START_SECONDS + 120)
        finally:
            self._process.join(timeout=10)
            if self._process.is_alive():
                self._process.kill()
        if isinstance(outcome, str):
            raise OutboxError(f"the bench's producer failed: {outcome}")
        return dict(outcome)


# -- what holds the horizon -------------------------------------------------------------
@contextlib.contextmanager
def hold(kind: str, dsn: str, table: str, suffix: str) -> Iterator[str | None]:
    """Hold the horizon as ``kind`` says until the block ends; yields why the run
    cannot be done on this server (None: held)."""
    if kind == "none":
        yield None
        return
    conn = session.connect(dsn, application_name=f"outbox-bench-{kind}")
    try:
        if kind in ("snapshot", "untouched"):
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            # The snapshot is taken by the first statement and kept to the end; the
            # count(*) also takes ACCESS SHARE on the outbox, as pg_dump does.
            conn.execute(f'SELECT count(*) FROM "{table}"' if kind == "snapshot" else "SELECT 1")
            yield None
        elif kind == "logical-slot":
            level = conn.execute("SELECT current_setting('wal_level') AS level").fetchone()
            if not level or level["level"] != "logical":
                yield "needs wal_level = logical (the private cluster has it)"
                return
            slot = f"outbox_bench_{suffix}"
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'test_decoding')", [slot])
            try:
                yield None
            finally:
                conn.execute("SELECT pg_drop_replication_slot(%s)", [slot])
        elif kind == "prepared":
            gid = f"outbox-bench-holder-{suffix}"
            conn.execute("BEGIN")
            conn.execute("SELECT pg_current_xact_id()")
            conn.execute(f"PREPARE TRANSACTION '{gid}'")
            try:
                yield None
            finally:
                conn.execute(f"ROLLBACK PREPARED '{gid}'")
        else:
            raise OutboxError(f"unknown holder {kind!r}")
    finally:
        conn.close()


# -- one run ----------------------------------------------------------------------------
def scrape_claims(port: int) -> tuple[float, float]:
    """(claims, seconds spent claiming) so far, from the relay's metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    count = total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "outbox_claim_duration_seconds":
            for sample in family.samples:
                if sample.name.endswith("_count"):
                    count = sample.value
                elif sample.name.endswith("_sum"):
                    total = sample.value
    return count, total


@dataclasses.dataclass
class Sample:
    """The figures read at one window boundary."""

    at: float  # perf_counter
    claims: float
    claim_seconds: float
    relay_cpu: float
    backend_cpu: float | None
    horizon: Horizon


def window_figures(
    committed: dict[str, float],
    arrived: dict[str, float],
    start: float,
    window: float,
    samples: Sequence[Sample],
) -> list[dict[str, Any]]:
    """Per window (by commit time): latency percentiles and the samples' deltas."""
    latencies: list[list[float]] = [[] for _ in range(max(0, len(samples) - 1))]
    for message_id, when in committed.items():
        index = int((when - start) // window)
        if 0 <= index < len(latencies) and message_id in arrived:
            latencies[index].append((arrived[message_id] - when) * 1000)
    committed_per_window = [0] * len(latencies)
    for when in committed.values():
        index = int((when - start) // window)
        if 0 <= index < len(latencies):
            committed_per_window[index] += 1
    rows = []
    for i, (before, after) in enumerate(itertools.pairwise(samples)):
        values = sorted(latencies[i])
        claims = after.claims - before.claims
        backend = (
            after.backend_cpu - before.backend_cpu
            if after.backend_cpu is not None and before.backend_cpu is not None
            else None
        )
        rows.append(
            {
                "window": i,
                "from_s": round(i * window, 1),
                "to_s": round((i + 1) * window, 1),
                "committed": committed_per_window[i],
                "delivered": len(values),
                "p50_ms": round(percentile(values, 50), 2) if values else None,
                "p99_ms": round(percentile(values, 99), 2) if values else None,
                "claims": int(claims),
                "claim_mean_ms": round(
                    1000 * (after.claim_seconds - before.claim_seconds) / claims, 3
                )
                if claims
                else None,
                "relay_cpu_ms_per_claim": round(
                    1000 * (after.relay_cpu - before.relay_cpu) / claims, 3
                )
                if claims
                else None,
                "backend_cpu_ms_per_claim": round(1000 * backend / claims, 3)
                if claims and backend is not None
                else None,
                "dead_rows": after.horizon.dead_rows,
                "table_bytes": after.horizon.table_bytes,
                "horizon_age_xids": after.horizon.age_xids,
            }
        )
    return rows


def holder_named(horizon: Horizon) -> str:
    """What ``outbox status`` names as the oldest holder of the outbox's dead rows;
    transactions younger than a second (a relay's own claim, say) do not count."""
    held = [
        h
        for h in horizon.holders
        if h.holds_outbox and (h.age_seconds is None or h.age_seconds >= 1.0)
    ]
    if not held:
        catalogs = [h for h in horizon.holders if not h.holds_outbox]
        if catalogs:
            return f"nothing holds the outbox ({catalogs[0].name}: system catalogs only)"
        return "nothing"
    oldest = max(held, key=lambda h: h.xmin_age_xids)
    d = oldest.detail
    if oldest.kind == "session":
        return f"session {d.get('application_name')!r} {d.get('state')}"
    return f"{oldest.kind.replace('_', ' ')} {oldest.name!r}"


def horizon_run(db: Database, o: HorizonOptions, kind: str, echo: Echo) -> dict[str, Any]:
    suffix = uuid.uuid4().hex[:8]
    table = f"outbox_horizon_{suffix}"
    conn = session.connect(db.dsn, application_name="outbox-bench")
    migrate.migrate(conn, table)
    # A topology per run: its blocking connection, idle for the whole run, would miss
    # its heartbeats and be closed by the broker.
    broker = BenchTopology(o.amqp_url, suffix)
    port = free_port()
    settings = Settings(dsn=db.dsn, amqp_url=o.amqp_url, table=table, ledger_queue=broker.ledger)
    reader = HorizonReader(db.dsn, table, application_name="outbox-bench-horizon")
    receiver = Receiver(o.amqp_url, broker.queue)
    receiver.start()
    receiver.ready.wait(10)
    relays = RelayProcesses(settings, 1, extra_env={"OUTBOX_METRICS_PORT": str(port)})
    try:
        wait_registered(conn, table, 1, relays)
        backends = Backends(conn)
        with hold(kind, db.dsn, table, suffix) as cannot:
            if cannot:
                echo(f"  {kind}: skipped, {cannot}")
                return {"holder": kind, "skipped": cannot}
            producer = Producer(db.dsn, table, broker.exchange, o)
            samples: list[Sample] = []

            def sample(at: float) -> None:
                pause = at - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                relays.check_alive()
                claims, claim_seconds = scrape_claims(port)
                samples.append(
                    Sample(
                        time.perf_counter(),
                        claims,
                        claim_seconds,
                        relays.cpu_seconds(),
                        backends.cpu_seconds(),
                        reader.horizon(limit=3),
                    )
                )

            windows = max(1, round(o.seconds / o.window_seconds))
            for i in range(windows + 1):
                sample(producer.start + min(o.seconds, i * o.window_seconds))
                if i:
                    echo(
                        f"  {kind}: {i * o.window_seconds:.0f} s, "
                        f"{samples[-1].horizon.dead_rows or 0:,} dead rows"
                    )
            committed = producer.result()
            named = holder_named(samples[-1].horizon)
        deadline = time.monotonic() + DRAIN_SECONDS
        while len(receiver.arrived) < len(committed) and time.monotonic() < deadline:
            relays.check_alive()
            time.sleep(0.1)
    finally:
        relays.stop()
        receiver.stop()
        reader.close()
        broker.delete()
        for name in ("", "_relays", "_dead_letters", "_claim_front", "_schema_version"):
            with contextlib.suppress(Exception):
                conn.execute(f'DROP TABLE IF EXISTS "{table}{name}" CASCADE')
        with contextlib.suppress(Exception):
            conn.execute(f'DROP FUNCTION IF EXISTS "{table}_notify"()')
        conn.close()
    rows = window_figures(committed, receiver.arrived, producer.start, o.window_seconds, samples)
    delivered = sum(1 for m in committed if m in receiver.arrived)
    first, last = rows[0], rows[-1]
    end = samples[-1].horizon
    return {
        "holder": kind,
        "skipped": None,
        "windows": rows,
        "sent": len(committed),
        "delivered": delivered,
        "duplicates": receiver.duplicates,
        "p50_last_to_first": ratio(last["p50_ms"], first["p50_ms"]),
        "p99_last_to_first": ratio(last["p99_ms"], first["p99_ms"]),
        "dead_rows_end": end.dead_rows,
        "table_bytes_end": end.table_bytes,
        "horizon_age_xids_end": end.age_xids,
        "status_names": named,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def run_horizon_bench(o: HorizonOptions, echo: Echo) -> dict[str, Any]:
    """Every holder's run, the control first; returns the figures."""
    with bench_database(o.dsn, echo, server_settings=LOGICAL_SETTINGS) as db:
        runs = []
        for kind in o.holders:
            echo(f"  {kind}: {o.seconds:.0f} s at {o.rate:,.0f} rows/s ...")
            runs.append(horizon_run(db, o, kind, echo))
    control = next((r for r in runs if r["holder"] == "none" and not r["skipped"]), None)
    for run in runs:
        if run["skipped"] or control is None:
            continue
        run["last_p50_to_control"] = ratio(
            run["windows"][-1]["p50_ms"], control["windows"][-1]["p50_ms"]
        )
        run["last_p99_to_control"] = ratio(
            run["windows"][-1]["p99_ms"], control["windows"][-1]["p99_ms"]
        )
    done = [r for r in runs if not r["skipped"]]
    return {
        "postgres": db.description,
        "rate": o.rate,
        "rows_per_commit": o.rows_per_commit,
        "payload_bytes": o.payload,
        "seconds": o.seconds,
        "window_seconds": o.window_seconds,
        "runs": runs,
        "every_row_arrived": bool(done)
        and all(r["delivered"] == r["sent"] and r["duplicates"] == 0 for r in done),
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _mib(size: int | None) -> str:
    return "-" if size is None else f"{size / 2**20:.1f} MiB"


def render(report: dict[str, Any]) -> str:
    lines = [
        f"outbox bench --horizon: {report['rate']:,.0f} rows/s in {report['rows_per_commit']}-row "
        f"transactions of {report['payload_bytes']} B payloads, {report['seconds']:.0f} s per "
        f"run, windows of {report['window_seconds']:.0f} s; one relay, default settings; "
        f"PostgreSQL: {report['postgres']}",
        "",
        "| holder | p50 first → last | p99 first → last | last/first p50 | last p50 vs "
        "nothing held | dead rows at the end | table at the end | `outbox status` names |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for run in report["runs"]:
        if run["skipped"]:
            lines.append(f"| {run['holder']} | skipped: {run['skipped']} | | | | | | |")
            continue
        first, last = run["windows"][0], run["windows"][-1]
        lines.append(
            f"| {run['holder']} | {_ms(first['p50_ms'])} → {_ms(last['p50_ms'])} ms | "
            f"{_ms(first['p99_ms'])} → {_ms(last['p99_ms'])} ms | "
            f"{_x(run['p50_last_to_first'])} | {_x(run.get('last_p50_to_control'))} | "
            f"{run['dead_rows_end'] or 0:,} | {_mib(run['table_bytes_end'])} | "
            f"{run['status_names']} |"
        )
    lines += [
        "",
        "per window (commit time); claim: the relay's outbox_claim_duration_seconds; CPU: "
        "the relay process and its PostgreSQL backends (/proc), per claim",
        "",
        "| holder | window | p50 | p99 | claims | claim mean | relay CPU/claim | "
        "PostgreSQL CPU/claim | dead rows | table |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in report["runs"]:
        if run["skipped"]:
            continue
        for w in run["windows"]:
            lines.append(
                f"| {run['holder']} | {w['from_s']:.0f}-{w['to_s']:.0f} s | "
                f"{_ms(w['p50_ms'])} ms | {_ms(w['p99_ms'])} ms | {w['claims']:,} | "
                f"{_ms3(w['claim_mean_ms'])} ms | {_ms3(w['relay_cpu_ms_per_claim'])} ms | "
                f"{_ms3(w['backend_cpu_ms_per_claim'])} ms | {w['dead_rows'] or 0:,} | "
                f"{_mib(w['table_bytes'])} |"
            )
    lines += [
        "",
        "every row arrived exactly once" if report["every_row_arrived"] else "ROWS MISSING",
    ]
    return "\n".join(lines)


def _ms3(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
