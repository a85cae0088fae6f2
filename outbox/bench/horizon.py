"""``outbox bench --horizon``: the relay while something holds the MVCC horizon.

Every row the relay deletes stays in the table as a dead tuple until no snapshot
can see it (DESIGN, "Facts for the MVCC horizon").  Here an application commits at
a fixed rate (``rate`` rows/s in transactions of ``rows_per_commit`` rows with
``payload``-byte payloads: 1,000 rows/s, 10 rows, 200 B as issue 33 measured; row
*i*'s ordering key is *i* mod ``keys`` as ``outbox bench``'s ordering runs write
them, or none) to a fresh outbox table while ``relays`` relays with default
settings run, for ``seconds``, once per holder of the horizon:

- ``none``: nothing held (the control run);
- ``snapshot``: a REPEATABLE READ transaction that read the outbox, keeping its
  ACCESS SHARE lock to the end, as ``pg_dump`` or a report does;
- ``untouched``: a REPEATABLE READ transaction that never touched the outbox
  (same horizon, no lock: what a rotating design can and cannot live with);
- ``logical-slot``: a logical replication slot (``test_decoding``; needs
  ``wal_level = logical``, which the private cluster has).  It holds only
  ``catalog_xmin``: the system catalogs' dead rows, not the outbox's;
- ``physical-slot``: a physical replication slot whose hot standby
  (``hot_standby_feedback = on``, ``outbox.bench.standby``) holds a REPEATABLE READ
  snapshot: the slot's ``xmin`` holds every table's dead rows (the private cluster
  only: the standby is a base backup of the whole server);
- ``prepared``: another application's prepared transaction.

Per window of ``window_seconds`` (by commit time): commit → delivery latency
p50/p99 (the consumer's clock and the producers' are the same machine's
CLOCK_MONOTONIC), claims and the claim's mean time (the relays' own
``outbox_claim_duration_seconds`` histograms, scraped from each one's metrics
endpoint and summed), the relays' and their PostgreSQL backends' CPU per claim
(``/proc``, all relays together), the outbox's
dead rows (``pg_stat_user_tables.n_dead_tup``) and its size with indexes; and at
the end what ``outbox status`` names as the horizon's holder.

With ``find_rate`` a ramp runs first, nothing held: ``rate``, then double, each
step two windows, until the backlog (rows committed and not yet delivered) grows
over the second window by more than a twentieth of its rows, or the writers fall
short of the rate; the last rate sustained is the holders' rate
(``sustained`` decides).  Benchmarks print figures; nothing here is a timed
assertion.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import multiprocessing
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from psycopg import pq

from outbox.bench.harness import (
    Backends,
    BenchTopology,
    Database,
    Echo,
    Receiver,
    RelayProcesses,
    bench_database,
    drop_outbox,
    ordering_key_sql,
    percentile,
    wait_registered,
)
from outbox.bench.standby import standby_holding
from outbox.config import Settings
from outbox.db import migrate, session
from outbox.db.devcluster import free_port
from outbox.db.horizon import Horizon, HorizonReader
from outbox.errors import OutboxError

HOLDERS = ("none", "snapshot", "untouched", "logical-slot", "physical-slot", "prepared")
DEFAULT_HOLDERS = "none,snapshot,untouched,logical-slot"

# The private cluster can host a logical slot; everything else is the bench's default.
LOGICAL_SETTINGS = {"wal_level": "logical", "max_replication_slots": "8", "max_wal_senders": "8"}

# After the writers stop, how long the bench waits for the last messages.
DRAIN_SECONDS = 120.0

# The ramp (``find_rate``): windows per step, the most steps, and what a step may
# fall short by (of the rate's rows in its last window) and still be sustained.
RAMP_WINDOWS = 2
RAMP_STEPS = 12
RAMP_SLACK = 0.05


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
    relays: int = 1
    keys: int = 0  # ordering keys the rows share; 0: none
    find_rate: bool = False
    # "outbox": the table's own autovacuum parameters, as ``outbox init`` sets them;
    # "server": reset to the server's defaults (what the parameters are worth).
    autovacuum: str = "outbox"


# The outbox table's own autovacuum parameters (schema 0001), reset by
# ``--table-autovacuum server``.
TABLE_AUTOVACUUM = (
    "autovacuum_vacuum_scale_factor",
    "autovacuum_vacuum_threshold",
    "autovacuum_vacuum_insert_scale_factor",
    "autovacuum_vacuum_insert_threshold",
    "autovacuum_analyze_scale_factor",
)


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
    keys: int,
    commits_per_s: float,
    seconds: float,
    gate: tuple[Any, Any, Any],
    results: Any,
) -> None:
    """Commit ``rows_per_commit`` rows at ``start + i / commits_per_s`` until ``start +
    seconds`` (``time.perf_counter``: due or now), ``start`` being what ``gate`` says
    (``Producer``: ready is set once connected, then go is waited for, and the start
    read); puts {message_id: when its COMMIT returned} on ``results`` (or the error,
    as text); with ``keys``, row *i* (counting from 1 over the run) has the key
    ``fill`` gives it.  One libpq call per transaction (the INSERT in autocommit), as
    ``harness.commit_rows`` does: the producer stands for an application elsewhere
    and must cost the relay it measures little."""
    ready, go, at = gate
    committed: dict[str, float] = {}
    try:
        with session.connect(dsn, application_name="outbox-bench-producer") as producer:
            pgconn = producer.pgconn
            prepared = pgconn.prepare(
                b"bench_commit",
                f'INSERT INTO "{table}" (message_id, exchange, routing_key, payload, '
                "ordering_key) SELECT m, $2, 'bench.horizon', $3::bytea, "
                f"{ordering_key_sql('$4::bigint + n', 'nullif($5::int, 0)')} "
                "FROM unnest($1::uuid[]) WITH ORDINALITY AS u(m, n)".encode(),
            )
            if prepared.status != pq.ExecStatus.COMMAND_OK:
                raise OutboxError(prepared.get_error_message())
            params = [
                b"",
                exchange.encode(),
                b"x" * payload,
                b"0",
                str(keys).encode(),  # 0: no key
            ]
            text, binary = pq.Format.TEXT, pq.Format.BINARY
            formats = [text, text, binary, text, text]
            ready.set()
            go.wait()
            start = at.value
            until = start + seconds
            i = 0
            while True:
                due = start + i / commits_per_s
                # Behind the rate (a ramp's step past the writers' ceiling), they
                # stop at ``until`` all the same: the run keeps its length.
                if due >= until or time.perf_counter() >= until:
                    break
                pause = due - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                ids = [str(uuid.uuid4()) for _ in range(rows_per_commit)]
                params[0] = ("{" + ",".join(ids) + "}").encode()
                params[3] = str(i * rows_per_commit).encode()
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

    def __init__(
        self,
        dsn: str,
        table: str,
        exchange: str,
        o: HorizonOptions,
        *,
        rate: float,
        seconds: float,
    ) -> None:
        """The process starts now; its first commit is due when ``begin`` says (after
        ``ready``: on a loaded machine spawning it may take longer than any fixed
        lead)."""
        context = multiprocessing.get_context("spawn")
        self._results = context.Queue()
        self._seconds = seconds
        self._ready, self._go = context.Event(), context.Event()
        self._at = context.Value("d", 0.0)
        self.start = self.until = math.inf
        self._process = context.Process(
            target=commit_batches,
            args=(
                dsn,
                table,
                exchange,
                o.payload,
                o.rows_per_commit,
                o.keys,
                rate / o.rows_per_commit,
                seconds,
                (self._ready, self._go, self._at),
                self._results,
            ),
            daemon=True,
        )
        self._process.start()

    def ready(self, timeout: float = 120.0) -> None:
        """Wait until the process is connected and ready to commit."""
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.2):
            if not self._process.is_alive():
                raise OutboxError(f"the bench's producer failed: {self._results.get(timeout=5)}")
            if time.monotonic() > deadline:
                raise OutboxError(f"the bench's producer did not start within {timeout:g} s")

    def begin(self, at: float) -> None:
        """The first commit is due at ``at`` (``time.perf_counter``)."""
        self.start, self.until = at, at + self._seconds
        self._at.value = at
        self._go.set()

    def result(self) -> dict[str, float]:
        try:
            outcome = self._results.get(timeout=max(0.0, self.until - time.perf_counter()) + 120)
        finally:
            self._process.join(timeout=10)
            if self._process.is_alive():
                self._process.kill()
        if isinstance(outcome, str):
            raise OutboxError(f"the bench's producer failed: {outcome}")
        return dict(outcome)


# -- what holds the horizon -------------------------------------------------------------
@contextlib.contextmanager
def hold(kind: str, dsn: str, table: str, suffix: str, *, private: bool) -> Iterator[str | None]:
    """Hold the horizon as ``kind`` says until the block ends; yields why the run
    cannot be done on this server (None: held).  ``private``: the bench's own
    cluster (a standby may be made of it)."""
    if kind == "none":
        yield None
        return
    if kind == "physical-slot":
        if not private:
            yield "needs the private cluster (omit --dsn): its standby is a base backup"
            return
        with standby_holding(dsn, f"outbox_bench_{suffix}"):
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
def scrape_claims(ports: Sequence[int]) -> tuple[float, float]:
    """(claims, seconds spent claiming) so far, summed over the relays' metrics
    endpoints."""
    claims = seconds = 0.0
    for port in ports:
        count, total = scrape_relay_claims(port)
        claims += count
        seconds += total
    return claims, seconds


def scrape_relay_claims(port: int) -> tuple[float, float]:
    """(claims, seconds spent claiming) so far, from one relay's metrics endpoint."""
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


def horizon_run(
    db: Database, o: HorizonOptions, kind: str, echo: Echo, *, rate: float, seconds: float
) -> dict[str, Any]:
    """One run of ``seconds`` at ``rate`` rows/s while ``kind`` holds the horizon."""
    suffix = uuid.uuid4().hex[:8]
    table = f"outbox_horizon_{suffix}"
    conn = session.connect(db.dsn, application_name="outbox-bench")
    migrate.migrate(conn, table)
    table_autovacuum(conn, table, o.autovacuum)
    # A topology per run: its blocking connection, idle for the whole run, would miss
    # its heartbeats and be closed by the broker.
    broker = BenchTopology(o.amqp_url, suffix)
    ports = [free_port() for _ in range(o.relays)]
    settings = Settings(dsn=db.dsn, amqp_url=o.amqp_url, table=table, ledger_queue=broker.ledger)
    reader = HorizonReader(db.dsn, table, application_name="outbox-bench-horizon")
    receiver = Receiver(o.amqp_url, broker.queue)
    receiver.start()
    receiver.ready.wait(10)
    relays = RelayProcesses(
        settings,
        o.relays,
        env_per_relay=[{"OUTBOX_METRICS_PORT": str(port)} for port in ports],
    )
    try:
        wait_registered(conn, table, o.relays, relays)
        backends = Backends(conn)
        with hold(kind, db.dsn, table, suffix, private=o.dsn is None) as cannot:
            if cannot:
                echo(f"  {kind}: skipped, {cannot}")
                return {"holder": kind, "skipped": cannot}
            producer = Producer(db.dsn, table, broker.exchange, o, rate=rate, seconds=seconds)
            producer.ready()
            producer.begin(time.perf_counter())
            samples: list[Sample] = []

            def sample(at: float) -> None:
                pause = at - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                relays.check_alive()
                claims, claim_seconds = scrape_claims(ports)
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

            windows = max(1, round(seconds / o.window_seconds))
            for i in range(windows + 1):
                sample(producer.start + min(seconds, i * o.window_seconds))
                if i:
                    echo(
                        f"  {kind}: {i * o.window_seconds:.0f} s, "
                        f"{samples[-1].horizon.dead_rows or 0:,} dead rows"
                    )
            committed = producer.result()
            named = holder_named(samples[-1].horizon)
            vacuums = autovacuums(conn, table)
        deadline = time.monotonic() + DRAIN_SECONDS
        while len(receiver.arrived) < len(committed) and time.monotonic() < deadline:
            relays.check_alive()
            time.sleep(0.1)
    finally:
        relays.stop()
        receiver.stop()
        reader.close()
        broker.delete()
        drop_outbox(conn, table)
        conn.close()
    rows = window_figures(committed, receiver.arrived, producer.start, o.window_seconds, samples)
    delivered = sum(1 for m in committed if m in receiver.arrived)
    first, last = rows[0], rows[-1]
    end = samples[-1].horizon
    last_from = producer.start + (len(rows) - 1) * o.window_seconds
    last_to = producer.start + min(seconds, len(rows) * o.window_seconds)
    return {
        "holder": kind,
        "skipped": None,
        "rate": rate,
        "last_window_seconds": last_to - last_from,
        "committed_last_window": sum(1 for t in committed.values() if last_from <= t < last_to),
        "backlog_growth_last_window": backlog(committed, receiver.arrived, last_to)
        - backlog(committed, receiver.arrived, last_from),
        "windows": rows,
        "sent": len(committed),
        "delivered": delivered,
        "duplicates": receiver.duplicates,
        "p50_last_to_first": ratio(last["p50_ms"], first["p50_ms"]),
        "p99_last_to_first": ratio(last["p99_ms"], first["p99_ms"]),
        "dead_rows_end": end.dead_rows,
        "table_bytes_end": end.table_bytes,
        "autovacuums": vacuums,
        "horizon_age_xids_end": end.age_xids,
        "status_names": named,
    }


def table_autovacuum(conn: Any, table: str, choice: str) -> None:
    """``choice`` "server": the table's own autovacuum parameters reset, so the
    server's defaults apply; "outbox": left as ``outbox init`` set them."""
    if choice == "server":
        conn.execute(f'ALTER TABLE "{table}" RESET ({", ".join(TABLE_AUTOVACUUM)})')
    elif choice != "outbox":
        raise ValueError(f"unknown autovacuum choice {choice!r}")


def autovacuums(conn: Any, table: str) -> int | None:
    """How many times autovacuum has vacuumed ``table`` (the statistics' count)."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT autovacuum_count AS n FROM pg_stat_user_tables WHERE relid = to_regclass(%s)",
        [f'"{table}"'],
    ).fetchone()
    return int(row["n"]) if row else None


def backlog(committed: dict[str, float], arrived: dict[str, float], at: float) -> int:
    """Rows committed by ``at`` and not yet delivered then."""
    return sum(1 for m, when in committed.items() if when <= at and arrived.get(m, math.inf) > at)


def sustained(run: dict[str, Any]) -> tuple[str, str] | None:
    """Who fell short of the run's rate over its last window and how (None: no
    one): the writers committed less than the rate ("writers": the ramp found
    their ceiling, not the relays'), or the backlog grew ("relays"), each by more
    than ``RAMP_SLACK`` of the window's rows."""
    planned = run["rate"] * run["last_window_seconds"]
    if run["committed_last_window"] < (1 - RAMP_SLACK) * planned:
        return "writers", (
            f"the writers committed {run['committed_last_window']:,} of "
            f"{planned:,.0f} rows in the last window"
        )
    if run["backlog_growth_last_window"] > RAMP_SLACK * planned:
        return "relays", (
            f"the backlog grew by {run['backlog_growth_last_window']:,} rows in the last window"
        )
    return None


def find_rate(db: Database, o: HorizonOptions, echo: Echo) -> dict[str, Any]:
    """From ``o.rate``, doubling, nothing held, ``RAMP_WINDOWS`` windows a step,
    until a step is not sustained; the highest rate sustained (None: not even
    ``o.rate``) and each step."""
    steps: list[dict[str, Any]] = []
    found = None
    rate = o.rate
    for _ in range(RAMP_STEPS):
        echo(f"  ramp: {rate:,.0f} rows/s ...")
        run = horizon_run(db, o, "none", echo, rate=rate, seconds=RAMP_WINDOWS * o.window_seconds)
        short = sustained(run)
        steps.append(
            {
                "rate": rate,
                "sustained": short is None,
                "fell_short": short[0] if short else None,
                "why_not": short[1] if short else None,
                "committed_last_window": run["committed_last_window"],
                "backlog_growth_last_window": run["backlog_growth_last_window"],
                "p99_last_ms": run["windows"][-1]["p99_ms"],
            }
        )
        if short is not None:
            echo(f"  ramp: {rate:,.0f} rows/s not sustained: {short[1]}")
            break
        found = rate
        rate *= 2
    return {"found": found, "steps": steps}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def run_horizon_bench(o: HorizonOptions, echo: Echo) -> dict[str, Any]:
    """Every holder's run, the control first; returns the figures."""
    with bench_database(o.dsn, echo, server_settings=LOGICAL_SETTINGS) as db:
        ramp = find_rate(db, o, echo) if o.find_rate else None
        rate = ramp["found"] if ramp and ramp["found"] else o.rate
        if ramp:
            echo(f"  ramp: the holders' runs at {rate:,.0f} rows/s")
        runs = []
        for kind in o.holders:
            echo(f"  {kind}: {o.seconds:.0f} s at {rate:,.0f} rows/s ...")
            runs.append(horizon_run(db, o, kind, echo, rate=rate, seconds=o.seconds))
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
        "rate": rate,
        "ramp": ramp,
        "relays": o.relays,
        "keys": o.keys,
        "rows_per_commit": o.rows_per_commit,
        "payload_bytes": o.payload,
        "seconds": o.seconds,
        "window_seconds": o.window_seconds,
        "autovacuum": o.autovacuum,
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
    relays = "one relay" if report["relays"] == 1 else f"{report['relays']} relays"
    keys = f"{report['keys']:,} ordering keys" if report["keys"] else "no ordering key"
    lines = [
        f"outbox bench --horizon: {report['rate']:,.0f} rows/s in {report['rows_per_commit']}-row "
        f"transactions of {report['payload_bytes']} B payloads, {keys}, "
        f"{report['seconds']:.0f} s per run, windows of {report['window_seconds']:.0f} s; "
        f"{relays}, default settings; PostgreSQL: {report['postgres']}; autovacuum: "
        + (
            "the server's defaults (the table's own parameters reset)"
            if report.get("autovacuum") == "server"
            else "the outbox table's own parameters (outbox init)"
        ),
        "",
        "| holder | p50 first → last | p99 first → last | last/first p50 | last p50 vs "
        "nothing held | dead rows at the end | table at the end | autovacuums | "
        "`outbox status` names |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for run in report["runs"]:
        if run["skipped"]:
            lines.append(f"| {run['holder']} | skipped: {run['skipped']} | | | | | | | |")
            continue
        first, last = run["windows"][0], run["windows"][-1]
        lines.append(
            f"| {run['holder']} | {_ms(first['p50_ms'])} → {_ms(last['p50_ms'])} ms | "
            f"{_ms(first['p99_ms'])} → {_ms(last['p99_ms'])} ms | "
            f"{_x(run['p50_last_to_first'])} | {_x(run.get('last_p50_to_control'))} | "
            f"{run['dead_rows_end'] or 0:,} | {_mib(run['table_bytes_end'])} | "
            f"{run.get('autovacuums')} | {run['status_names']} |"
        )
    lines += [
        "",
        "per window (commit time); claim: the relays' outbox_claim_duration_seconds; CPU: "
        "the relay processes and their PostgreSQL backends (/proc), per claim",
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
    lines += render_ramp(report["ramp"])
    lines += [
        "",
        "every row arrived exactly once" if report["every_row_arrived"] else "ROWS MISSING",
    ]
    return "\n".join(lines)


def render_ramp(ramp: dict[str, Any] | None) -> list[str]:
    if ramp is None:
        return []
    found = ramp["found"]
    lines = [
        "",
        f"the highest rate sustained, nothing held: {found:,.0f} rows/s"
        if found
        else "the highest rate sustained, nothing held: none (not even --rate)",
        "",
        "| ramp rows/s | sustained | committed in the last window | backlog growth | p99 |",
        "|---:|---|---:|---:|---:|",
    ]
    for step in ramp["steps"]:
        verdict = "yes" if step["sustained"] else f"no: {step['why_not']}"
        lines.append(
            f"| {step['rate']:,.0f} | {verdict} | {step['committed_last_window']:,} | "
            f"{step['backlog_growth_last_window']:,} | {_ms(step['p99_last_ms'])} ms |"
        )
    if ramp["steps"] and ramp["steps"][-1]["fell_short"] == "writers":
        lines += [
            "",
            "the writers, not the relays, fell short: the relays' ceiling is higher "
            "(more --rows-per-commit lifts the writers')",
        ]
    return lines


def _ms3(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
