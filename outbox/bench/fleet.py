"""``outbox bench --fleet``: many databases on one PostgreSQL cluster, one fleet.

Every database of the run is a copy of one migrated template (``fleet_00`` …), on
a private cluster (fsync on, ``max_connections`` and ``max_prepared_transactions``
raised to what two fleet relays, the writers and the bench need: ``sizing``) or on
the server ``--dsn`` names (databases of their own, dropped afterwards).  Writers
are processes of their own (``write_rows``: one session per database, each
database's rows due at ``rate`` per second, single-row commits of libpq's
``PQexecPrepared``, as the latency run's producers); each row's routing key is its
database, its message id chosen by the writer, so the consumer (``Arrivals``, a
thread of the bench) knows commit → delivery per database.  Relays are
subprocesses as deployed: ``outbox relay`` for one database, ``outbox relay
--targets FILE`` for the fleet.

The runs (``RUNS``; ``--fleet-runs`` picks some):

- ``baseline``: one single-database relay, one database written at ``rate``: p50/p99
  commit → delivery, and that relay's RSS and PostgreSQL sessions;
- ``one``, ``two``: every database written at ``rate``, served by one fleet relay,
  then by two (both serve every database; the databases arbitrate): p50/p99 per
  database and overall, p99 against the baseline's;
- ``idle``: no writes; once the targets are dormant (``dormant_after``), the fleet
  relays' CPU over ``idle_seconds``, their sessions per database (a relay's own
  sessions: the client ports of its sockets, ``/proc``, against
  ``pg_stat_activity``) and RSS; then one row in every database: how long a
  dormant database takes to deliver (it wakes up);
- ``backlog``: a dedicated single-database relay drains ``backlog`` rows committed
  at once (rows/s to the backlog's own queue); then one fleet relay drains the same
  backlog in one database while the others are written at ``rate``: their p99
  during the drain against the ``one`` run's, the drain's rate against the
  dedicated relay's;
- ``change``: one fleet relay, every database written; the last database is added
  to the targets file (seconds until its first row arrives), then the first one is
  removed (the largest gap between two deliveries of every other database); then
  the first is added back so that everything committed arrives.

Every committed row must arrive (``every_row_arrived``); duplicates are counted.
Benchmarks print figures, they never assert timings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import multiprocessing
import os
import queue
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import pika
from psycopg import pq, sql

from outbox.bench.harness import (
    BenchTopology,
    Echo,
    RelayProcesses,
    latency_figures,
    machine_ticks,
    process_cpu_seconds,
)
from outbox.config import Settings
from outbox.db import migrate, session
from outbox.db.devcluster import PostgresCluster
from outbox.errors import OutboxError
from outbox.fleet.targets import target_dsn

RUNS = ("baseline", "one", "two", "idle", "backlog", "change")

# Commits per second asked of one writer process (a thread and a session per
# database, each commit waiting for its WAL flush).
WRITER_COMMITS_PER_S = 500
# Seconds the writer processes get to start (imports, one session per database);
# the first rows are due once all have.
WRITER_START_SECONDS = 120.0
# Rows committed in the first seconds of a run are delivered and checked, but left
# out of the latency figures: the relays' sessions are warm by then.
WARMUP_SECONDS = 2.0
# How long the bench waits for rows still on their way once the writers stopped.
ARRIVAL_SECONDS = 60.0
# Sessions one relay may hold per database while busy (work, control, wake-up, and
# one spare), for ``max_connections``.
SESSIONS_PER_RELAY = 4


@dataclasses.dataclass(frozen=True)
class FleetOptions:
    amqp_url: str
    dsn: str | None = None  # None: a private cluster
    databases: int = 50
    rate: float = 20.0  # rows/s per database
    seconds: float = 30.0  # measured part of each written run
    idle_seconds: float = 60.0
    backlog: int = 200_000
    payload: int = 200
    dormant_after: float | None = None  # None: the fleet relay's default
    runs: tuple[str, ...] = RUNS


def parse_runs(text: str) -> tuple[str, ...]:
    """``baseline,one`` → the runs, in ``RUNS`` order; ValueError for an unknown one."""
    asked = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [run for run in asked if run not in RUNS]
    if unknown or not asked:
        raise ValueError(f"not runs of the fleet bench: {text!r} (choose from {', '.join(RUNS)})")
    return tuple(run for run in RUNS if run in asked)


@dataclasses.dataclass(frozen=True)
class Sizing:
    max_connections: int
    max_prepared_transactions: int


def sizing(databases: int, relays: int = 2) -> Sizing:
    """What the cluster needs: ``relays`` fleet relays at ``SESSIONS_PER_RELAY``
    sessions per database, a writer session per database, a dedicated relay, the
    bench's own sessions and PostgreSQL's reserve; two batches in flight per relay
    and database (pipelined)."""
    return Sizing(
        max_connections=relays * databases * SESSIONS_PER_RELAY + databases + 40,
        max_prepared_transactions=max(64, relays * databases * 2 + 8),
    )


# -- the databases ------------------------------------------------------------------
@dataclasses.dataclass
class Fleet:
    server_dsn: str  # the admin database: pg_stat_activity, CREATE DATABASE
    names: list[str]
    dsns: list[str]
    description: str
    max_connections: int


@contextlib.contextmanager
def fleet_databases(dsn: str | None, databases: int, echo: Echo) -> Iterator[Fleet]:
    """``databases`` copies of a migrated template, on the server ``dsn`` reaches (a
    prefix of their own, dropped afterwards) or on a private cluster."""
    if dsn:
        prefix = f"outbox_fleet_{uuid.uuid4().hex[:6]}"
        with _databases(dsn, prefix, databases, echo) as fleet:
            fleet.description = "the server given by --dsn"
            yield fleet
        return
    size = sizing(databases)
    echo(
        f"starting a private PostgreSQL (fsync on, max_connections = {size.max_connections}, "
        f"max_prepared_transactions = {size.max_prepared_transactions}) ..."
    )
    with (
        PostgresCluster(
            durable=True,
            max_prepared_transactions=size.max_prepared_transactions,
            extra_settings={"max_connections": str(size.max_connections)},
        ) as cluster,
        _databases(cluster.dsn, "fleet", databases, echo) as fleet,
    ):
        fleet.description = "private cluster, fsync on"
        yield fleet


@contextlib.contextmanager
def _databases(server_dsn: str, prefix: str, count: int, echo: Echo) -> Iterator[Fleet]:
    template = f"{prefix}_template"
    width = max(2, len(str(count - 1)))
    names = [f"{prefix}_{n:0{width}d}" for n in range(count)]
    admin = session.connect(server_dsn, application_name="outbox-bench")
    try:
        row = admin.execute("SHOW max_connections").fetchone()
        max_connections = int(row["max_connections"]) if row else 0
        need = sizing(count).max_connections
        if max_connections < need:
            echo(
                f"  note: max_connections is {max_connections}; two fleet relays on {count} "
                f"databases with their writers may need up to {need}"
            )
        echo(f"  creating {count} databases, each with the outbox table ...")
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(template)))
        with session.connect(
            target_dsn(server_dsn, template), application_name="outbox-bench"
        ) as t:
            migrate.migrate(t, "outbox")
        for name in names:
            admin.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                    sql.Identifier(name), sql.Identifier(template)
                )
            )
        yield Fleet(
            server_dsn,
            names,
            [target_dsn(server_dsn, name) for name in names],
            "",
            max_connections,
        )
    finally:
        for name in [*names, template]:
            with contextlib.suppress(Exception):
                _drop(admin, server_dsn, name)
        admin.close()


def _drop(admin: session.Conn, server_dsn: str, name: str) -> None:
    """Drop a bench database, rolling back what a stopped relay left prepared in it."""
    rows = admin.execute("SELECT gid FROM pg_prepared_xacts WHERE database = %s", [name]).fetchall()
    if rows:
        with session.connect(target_dsn(server_dsn, name), application_name="outbox-bench") as db:
            for row in rows:
                with contextlib.suppress(Exception):
                    db.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(row["gid"])))
    admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


# -- the consumer -------------------------------------------------------------------
class Arrivals(threading.Thread):
    """Consumes a queue; notes when each message id arrived, and every arrival's
    time per routing key (the database)."""

    def __init__(self, amqp_url: str, queue: str) -> None:
        super().__init__(daemon=True)
        self.arrived: dict[str, float] = {}
        self.by_key: dict[str, list[float]] = {}
        self.duplicates = 0
        self._amqp_url, self._queue = amqp_url, queue
        self._halt = threading.Event()
        self.ready = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            params = pika.URLParameters(self._amqp_url)
            conn = pika.BlockingConnection(params)
            channel = conn.channel()
            channel.basic_qos(prefetch_count=1000)

            def on_message(_ch: Any, method: Any, props: Any, _body: bytes) -> None:
                now = time.perf_counter()
                if props.message_id in self.arrived:
                    self.duplicates += 1
                    return
                self.arrived[props.message_id] = now
                self.by_key.setdefault(method.routing_key, []).append(now)

            channel.basic_consume(self._queue, on_message, auto_ack=True)
            self.ready.set()
            while not self._halt.is_set():
                conn.process_data_events(time_limit=0.05)
            conn.close()
        except BaseException as exc:  # reported by the bench
            self.error = exc
            self.ready.set()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)


@contextlib.contextmanager
def arrivals(amqp_url: str, queue: str) -> Iterator[Arrivals]:
    receiver = Arrivals(amqp_url, queue)
    receiver.start()
    receiver.ready.wait(10)
    if receiver.error is not None:
        raise OutboxError(f"the bench's consumer failed: {receiver.error}")
    try:
        yield receiver
    finally:
        receiver.stop()


# -- the writers ------------------------------------------------------------------------
def write_rows(
    jobs: Sequence[tuple[int, str, str, float]],
    exchange: str,
    payload: int,
    rate: float,
    seconds: float | None,
    rows_each: int | None,
    clock: Any,
    go: Any,
    stop: Any,
    results: Any,
) -> None:
    """One writer process: a thread per database of ``jobs`` ((index, dsn, routing
    key, phase)).  Once every thread has its session it puts "ready" on ``results``
    and waits for ``go``; then each thread commits a row every ``1 / rate`` s from
    ``clock.value + phase`` (``time.perf_counter``) for ``seconds`` (None: until
    ``stop``), ``rows_each`` rows at most.  Puts {index: [(message id, when its
    commit returned)]} on ``results`` (or the error, as text).

    A thread per session, not one loop over all: each commit waits for its WAL
    flush, and sessions that wait side by side share one flush (group commit),
    where one loop over 25 databases reached 3 of their 20 rows/s on a busy 2-core
    machine.  libpq's call releases the GIL while it waits."""
    committed: dict[int, list[tuple[str, float]]] = {job[0]: [] for job in jobs}
    errors: list[str] = []
    body = b"x" * payload
    formats = [pq.Format.TEXT, pq.Format.TEXT, pq.Format.TEXT, pq.Format.BINARY]
    connected = threading.Barrier(len(jobs) + 1)
    begin = threading.Event()

    def write(index: int, dsn: str, key: str, phase: float) -> None:
        try:
            with session.connect(dsn, application_name="outbox-bench-writer") as conn:
                pgconn = conn.pgconn
                prepared = pgconn.prepare(
                    b"bench_write",
                    b'INSERT INTO "outbox" (message_id, exchange, routing_key, payload) '
                    b"VALUES ($1::uuid, $2, $3, $4::bytea)",
                )
                if prepared.status != pq.ExecStatus.COMMAND_OK:
                    raise OutboxError(prepared.get_error_message())
                connected.wait()
                begin.wait()
                start = clock.value
                until = math.inf if seconds is None else start + seconds
                rows = committed[index]
                i = 0
                while rows_each is None or i < rows_each:
                    due = start + phase + i / rate
                    # A writer behind its schedule (a busy machine) still stops at
                    # ``until``: the rate it reached says so.
                    if due > until or stop.is_set() or time.perf_counter() > until:
                        break
                    pause = due - time.perf_counter()
                    if pause > 0 and stop.wait(pause):
                        break
                    message_id = str(uuid.uuid4())
                    result = pgconn.exec_prepared(
                        b"bench_write",
                        [message_id.encode(), exchange.encode(), key.encode(), body],
                        formats,
                    )
                    if result.status != pq.ExecStatus.COMMAND_OK:
                        raise OutboxError(result.get_error_message())
                    rows.append((message_id, time.perf_counter()))
                    i += 1
        except threading.BrokenBarrierError:
            pass  # another thread failed: its error is reported
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            connected.abort()

    threads = [threading.Thread(target=write, args=job, daemon=True) for job in jobs]
    for thread in threads:
        thread.start()
    try:
        connected.wait()
        results.put("ready")
        go.wait()
    except threading.BrokenBarrierError:
        pass
    begin.set()
    for thread in threads:
        thread.join()
    results.put(errors[0] if errors else committed)


class Writers:
    """Writer processes for ``indices`` of the fleet, started at once; ``start`` is
    when the first rows are due."""

    def __init__(
        self,
        fleet: Fleet,
        indices: Sequence[int],
        exchange: str,
        options: FleetOptions,
        *,
        seconds: float | None,
        rate: float | None = None,
        rows_each: int | None = None,
    ) -> None:
        """``seconds`` (None: until ``stop``), ``rows_each`` rows at most per
        database, at ``rate`` rows/s each (default ``options.rate``)."""
        context = multiprocessing.get_context("spawn")  # no fork of a threaded process
        rate = options.rate if rate is None else rate
        self.indices = list(indices)
        self._stop = context.Event()
        self._results = context.Queue()
        clock, go = context.Value("d", 0.0), context.Event()
        count = max(1, min(len(indices), math.ceil(len(indices) * rate / WRITER_COMMITS_PER_S)))
        # Database n's rows are due 1 / (rate x databases) after database n-1's.
        jobs = [
            (i, fleet.dsns[i], fleet.names[i], n / (rate * len(indices)))
            for n, i in enumerate(indices)
        ]
        self._procs = [
            context.Process(
                target=write_rows,
                args=(
                    jobs[n::count],
                    exchange,
                    options.payload,
                    rate,
                    seconds,
                    rows_each,
                    clock,
                    go,
                    self._stop,
                    self._results,
                ),
                daemon=True,
            )
            for n in range(count)
        ]
        for proc in self._procs:
            proc.start()
        self.committed: dict[int, list[tuple[str, float]]] = {}
        # Every writer connected to its databases first: the clock starts after.
        for _ in self._procs:
            ready = self._get(WRITER_START_SECONDS)
            if ready != "ready":
                self.stop()
                go.set()
                raise OutboxError(f"a bench writer failed: {ready}")
        self.start = clock.value = time.perf_counter() + 0.2
        go.set()

    def _get(self, timeout: float) -> Any:
        try:
            return self._results.get(timeout=timeout)
        except queue.Empty:
            raise OutboxError(f"a bench writer did not report within {timeout:.0f} s") from None

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> None:
        """Wait for every writer's rows (``stop`` first for an open-ended run)."""
        try:
            for _ in self._procs:
                outcome = self._get(timeout)
                if isinstance(outcome, str):
                    raise OutboxError(f"a bench writer failed: {outcome}")
                self.committed.update(outcome)
        finally:
            for proc in self._procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()

    def ids(self) -> dict[str, tuple[int, float]]:
        return {mid: (i, t) for i, rows in self.committed.items() for mid, t in rows}

    def rate_reached(self) -> float:
        """Rows committed per second and database, first commit to last (the mean
        over the databases)."""
        rates = []
        for rows in self.committed.values():
            if len(rows) > 1 and rows[-1][1] > rows[0][1]:
                rates.append((len(rows) - 1) / (rows[-1][1] - rows[0][1]))
        return statistics.mean(rates) if rates else 0.0


def wait_arrived(writers: Writers, receiver: Arrivals, timeout: float = ARRIVAL_SECONDS) -> int:
    """Wait until every committed row arrived (``timeout`` at most); returns how many
    did not."""
    ids = writers.ids()
    deadline = time.monotonic() + timeout
    while True:
        missing = sum(1 for mid in ids if mid not in receiver.arrived)
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.2)


def latencies(
    writers: Writers,
    indices: Sequence[int],
    *,
    since: float,
    until: float = math.inf,
) -> dict[int, dict[str, float]]:
    """{database index: {message id: commit time}} for rows committed in [since, until)."""
    return {
        i: {mid: t for mid, t in writers.committed.get(i, []) if since <= t < until}
        for i in indices
    }


def figures(
    committed: dict[int, dict[str, float]], receiver: Arrivals, names: Sequence[str]
) -> dict[str, Any]:
    """p50/p99 overall and per database; the spread of the databases' p99."""
    overall: dict[str, float] = {}
    per_database: dict[str, Any] = {}
    for i, rows in committed.items():
        overall.update(rows)
        per_database[names[i]] = latency_figures(rows, 0.0, receiver.arrived)
    result = latency_figures(overall, 0.0, receiver.arrived)
    for entry in [result, *per_database.values()]:
        entry.pop("committed_per_s", None)
        for key, value in entry.items():
            if isinstance(value, float) and math.isnan(value):
                entry[key] = None  # no row: no percentile (and JSON has no NaN)
    p99s = sorted(e["p99_ms"] for e in per_database.values() if e["delivered"])
    result["database_p99_ms"] = {
        "median": round(statistics.median(p99s), 2) if p99s else None,
        "max": round(p99s[-1], 2) if p99s else None,
    }
    result["per_database"] = per_database
    return result


# -- relays ---------------------------------------------------------------------------
class TargetsFile:
    """The fleet's targets file, replaced whole (a new inode) on each change."""

    def __init__(self, directory: str, dsns: Sequence[str]) -> None:
        self.path = os.path.join(directory, "targets")
        self.write(dsns)

    def write(self, dsns: Sequence[str]) -> float:
        """Replace the file; returns when (``time.perf_counter``)."""
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path))
        with os.fdopen(fd, "w") as file:
            file.write("".join(f"{dsn}\n" for dsn in dsns))
        os.replace(tmp, self.path)
        return time.perf_counter()


def fleet_relays(
    settings: Settings, targets: TargetsFile, count: int, dormant_after: float | None
) -> RelayProcesses:
    """``count`` ``outbox relay --targets FILE`` processes."""
    args = ["--targets", targets.path]
    if dormant_after is not None:
        args += ["--dormant-after", str(dormant_after)]
    # The fleet has its own default --dormant-after; Settings would say 0 (never).
    unset = ("OUTBOX_DSN", "OUTBOX_DORMANT_AFTER")
    return RelayProcesses(settings, count, args=args, unset=unset)


def relay_ports(pid: int) -> set[int]:
    """The local TCP ports of process ``pid``'s sockets (``/proc``): a relay's
    sessions are the ``pg_stat_activity`` rows with these ``client_port``."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as file:
            next(file)
            for line in file:
                fields = line.split()
                if fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def sessions(fleet: Fleet, relays: RelayProcesses) -> list[dict[str, int]]:
    """Per relay: {database name: its sessions there}."""
    with session.connect(fleet.server_dsn, application_name="outbox-bench-stats") as stats:
        rows = stats.execute(
            "SELECT datname, client_port FROM pg_stat_activity WHERE client_port IS NOT NULL"
        ).fetchall()
    result = []
    for proc in relays.procs:
        ports = relay_ports(proc.pid)
        counts = dict.fromkeys(fleet.names, 0)
        for row in rows:
            if row["client_port"] in ports and row["datname"] in counts:
                counts[row["datname"]] += 1
        result.append(counts)
    return result


def memory(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of a process, MiB."""
    values: dict[str, float] = {}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as status:
        for line in status:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "VmHWM"):
                values[key] = round(int(line.split()[1]) / 1024, 1)
    return {"rss_mib": values.get("VmRSS", 0.0), "peak_rss_mib": values.get("VmHWM", 0.0)}


def wait_serving(
    fleet: Fleet, indices: Sequence[int], relays: RelayProcesses, timeout: float = 120.0
) -> float:
    """Wait until every relay has a session in each of ``indices``' databases;
    returns the seconds it took."""
    started = time.perf_counter()
    deadline = time.monotonic() + timeout
    wanted = {fleet.names[i] for i in indices}
    while True:
        relays.check_alive()
        if all(all(counts[name] >= 1 for name in wanted) for counts in sessions(fleet, relays)):
            return time.perf_counter() - started
        if time.monotonic() > deadline:
            raise OutboxError(f"the bench relays did not connect to every database in {timeout} s")
        time.sleep(0.2)


def wait_registered(dsn: str, count: int, relays: RelayProcesses, timeout: float = 60.0) -> None:
    """Wait until ``count`` relays are registered in the database ``dsn`` reaches."""
    deadline = time.monotonic() + timeout
    with session.connect(dsn, application_name="outbox-bench") as conn:
        while True:
            relays.check_alive()
            row = conn.execute('SELECT count(*) AS n FROM "outbox_relays"').fetchone()
            if row and row["n"] >= count:
                return
            if time.monotonic() > deadline:
                raise OutboxError(f"the bench relays did not register within {timeout} s")
            time.sleep(0.05)


# -- the bench ---------------------------------------------------------------------------
class FleetBench:
    def __init__(self, options: FleetOptions, fleet: Fleet, echo: Echo) -> None:
        self.o, self.fleet, self.echo = options, fleet, echo
        suffix = uuid.uuid4().hex[:8]
        self.broker = BenchTopology(options.amqp_url, f"fleet.{suffix}")
        self.backlog_broker = BenchTopology(options.amqp_url, f"fleet.backlog.{suffix}")
        self.dir = tempfile.mkdtemp(prefix="outbox-bench-fleet-")
        self.lost = 0
        self.duplicates = 0

    def close(self) -> None:
        self.broker.delete()
        self.backlog_broker.delete()
        with contextlib.suppress(OSError):
            for name in os.listdir(self.dir):
                os.unlink(os.path.join(self.dir, name))
            os.rmdir(self.dir)

    def settings(self, dsn: str | None = None) -> Settings:
        return Settings(
            dsn=dsn or self.fleet.dsns[0],
            amqp_url=self.o.amqp_url,
            table="outbox",
            ledger_queue=self.broker.ledger,
        )

    def all(self) -> list[int]:
        return list(range(len(self.fleet.dsns)))

    def _written(
        self,
        relays: RelayProcesses,
        indices: Sequence[int],
        *,
        seconds: float | None = None,
    ) -> tuple[Writers, Arrivals, dict[str, Any]]:
        """Write ``indices`` for the run's length, wait for every row; returns the
        writers, the consumer and the figures of the measured part."""
        seconds = WARMUP_SECONDS + (self.o.seconds if seconds is None else seconds)
        with arrivals(self.o.amqp_url, self.broker.queue) as receiver:
            cpu0, machine0 = relays.cpu_seconds(), machine_ticks()
            writers = Writers(self.fleet, indices, self.broker.exchange, self.o, seconds=seconds)
            writers.join(timeout=seconds + 120)
            relays.check_alive()
            self._account(wait_arrived(writers, receiver), receiver)
            cpu, ended = relays.cpu_seconds() - cpu0, time.perf_counter()
            machine1 = machine_ticks()
        since = writers.start + WARMUP_SECONDS
        result = figures(latencies(writers, indices, since=since), receiver, self.fleet.names)
        result["committed_per_s_per_database"] = round(writers.rate_reached(), 2)
        # The relays' CPU from the writers' start until the last row arrived.
        rows = sum(len(committed) for committed in writers.committed.values())
        result["relay_cpu_percent_of_a_core"] = round(100 * cpu / (ended - writers.start), 1)
        result["relay_cpu_ms_per_row"] = round(1000 * cpu / rows, 2) if rows else None
        # How busy the machine's CPUs were meanwhile (the servers, writers and
        # consumer of the bench included, and whatever else runs).
        busy, total = machine1[0] - machine0[0], machine1[1] - machine0[1]
        result["machine_busy_percent"] = round(100 * busy / total, 1) if total else None
        if len(indices) > 1:
            # The databases but the first, which the backlog run loads: its baseline.
            others = figures(
                latencies(writers, indices[1:], since=since), receiver, self.fleet.names
            )
            result["others_p99_ms"] = others["p99_ms"]
        return writers, receiver, result

    def _account(self, missing: int, receiver: Arrivals) -> None:
        self.lost += missing
        self.duplicates += receiver.duplicates

    # The runs --------------------------------------------------------------------------
    def baseline(self) -> dict[str, Any]:
        """One single-database relay, one database at ``rate``."""
        self.echo(f"  baseline: one relay, one database at {self.o.rate:g} rows/s ...")
        relays = RelayProcesses(self.settings(self.fleet.dsns[0]), 1)
        try:
            wait_registered(self.fleet.dsns[0], 1, relays)
            _writers, _receiver, result = self._written(relays, [0])
            result["relay"] = memory(relays.procs[0].pid)
            result["relay"]["sessions"] = sessions(self.fleet, relays)[0][self.fleet.names[0]]
        finally:
            relays.stop()
        return result

    def fleet_run(self, count: int, *, then_idle: bool = False) -> dict[str, Any]:
        """Every database at ``rate``, ``count`` fleet relays (then, perhaps, idle)."""
        self.echo(
            f"  {len(self.fleet.dsns)} databases at {self.o.rate:g} rows/s each, "
            f"{count} fleet relay(s) ..."
        )
        targets = TargetsFile(self.dir, self.fleet.dsns)
        relays = fleet_relays(self.settings(), targets, count, self.o.dormant_after)
        try:
            result: dict[str, Any] = {"relays": count}
            result["start_s"] = round(wait_serving(self.fleet, self.all(), relays), 2)
            _writers, _receiver, written = self._written(relays, self.all())
            result.update(written)
            # Each relay's sessions in all the databases, just after the writes.
            result["sessions_per_relay"] = [
                sum(counts.values()) for counts in sessions(self.fleet, relays)
            ]
            result["relay_memory"] = [memory(proc.pid) for proc in relays.procs]
            if then_idle:
                result["idle"] = self._idle(relays)
        finally:
            relays.stop()
        return result

    def idle(self) -> dict[str, Any]:
        targets = TargetsFile(self.dir, self.fleet.dsns)
        relays = fleet_relays(self.settings(), targets, 2, self.o.dormant_after)
        try:
            wait_serving(self.fleet, self.all(), relays)
            return self._idle(relays)
        finally:
            relays.stop()

    def _idle(self, relays: RelayProcesses) -> dict[str, Any]:
        """The relays with nothing to do, once dormant: CPU, sessions, RSS; then one row
        in every database (the wake-up)."""
        dormant = self.o.dormant_after if self.o.dormant_after is not None else 30.0
        self.echo(
            f"  idle: {len(self.fleet.dsns)} databases, no writes; waiting {dormant + 5:g} s "
            f"for the targets to go dormant, then {self.o.idle_seconds:g} s of idle ..."
        )
        time.sleep(dormant + 5)
        cpu0 = [process_cpu_seconds(proc.pid) or 0.0 for proc in relays.procs]
        t0 = time.perf_counter()
        time.sleep(self.o.idle_seconds)
        cpu1 = [process_cpu_seconds(proc.pid) or 0.0 for proc in relays.procs]
        seconds = time.perf_counter() - t0
        per_relay = sessions(self.fleet, relays)
        counts = [n for counts in per_relay for n in counts.values()]
        total = sum(counts)
        result: dict[str, Any] = {
            "relays": len(relays.procs),
            "seconds": round(seconds, 1),
            "cpu_percent_of_a_core": [
                round(100 * (b - a) / seconds, 3) for a, b in zip(cpu0, cpu1, strict=True)
            ],
            "sessions_per_database_per_relay_max": max(counts, default=0),
            "sessions_per_database_per_relay_mean": round(total / max(1, len(counts)), 2),
            "sessions_total": total,
            "max_connections": self.fleet.max_connections,
            "relay_memory": [memory(proc.pid) for proc in relays.procs],
        }
        result["wake_up"] = self._wake_up(relays)
        return result

    def _wake_up(self, relays: RelayProcesses) -> dict[str, Any]:
        """One row in every (dormant) database: commit → delivery."""
        with arrivals(self.o.amqp_url, self.broker.queue) as receiver:
            writers = Writers(
                self.fleet, self.all(), self.broker.exchange, self.o, seconds=None, rows_each=1
            )
            writers.join(timeout=120)
            relays.check_alive()
            self._account(wait_arrived(writers, receiver), receiver)
        committed = latencies(writers, self.all(), since=0.0)
        result = figures(committed, receiver, self.fleet.names)
        result.pop("per_database")
        return result

    def backlog(self, without: float | None) -> dict[str, Any]:
        """A dedicated relay drains the backlog alone; then one fleet relay drains it
        while the other databases are written (``without``: their p99 in the ``one``
        run, with no backlog)."""
        rows = self.o.backlog
        self.echo(f"  backlog: a dedicated relay drains {rows:,} rows alone ...")
        relays = RelayProcesses(self.settings(self.fleet.dsns[0]), 1)
        try:
            wait_registered(self.fleet.dsns[0], 1, relays)
            dedicated = self._drain(relays)
        finally:
            relays.stop()
        self.echo(
            f"  backlog: one fleet relay drains {rows:,} rows in one database while the "
            f"other {len(self.fleet.dsns) - 1} are written at {self.o.rate:g} rows/s ..."
        )
        others = self.all()[1:]
        targets = TargetsFile(self.dir, self.fleet.dsns)
        relays = fleet_relays(self.settings(), targets, 1, self.o.dormant_after)
        try:
            wait_serving(self.fleet, self.all(), relays)
            with arrivals(self.o.amqp_url, self.broker.queue) as receiver:
                writers = Writers(self.fleet, others, self.broker.exchange, self.o, seconds=None)
                try:
                    pause = writers.start + WARMUP_SECONDS - time.perf_counter()
                    time.sleep(max(0.0, pause))
                    drain = self._drain(relays)
                    # Writes go on as long as a latency run would, at least.
                    rest = writers.start + WARMUP_SECONDS + self.o.seconds - time.perf_counter()
                    time.sleep(max(0.0, rest))
                finally:
                    writers.stop()
                    writers.join(timeout=120)
                self._account(wait_arrived(writers, receiver), receiver)
        finally:
            relays.stop()
        during = figures(
            latencies(
                writers,
                others,
                since=drain["committed_at"],
                until=drain["committed_at"] + drain["seconds"],
            ),
            receiver,
            self.fleet.names,
        )
        result: dict[str, Any] = {
            "rows": rows,
            "dedicated": _public(dedicated),
            "fleet": _public(drain),
            "drain_ratio": round(drain["rows_per_s"] / dedicated["rows_per_s"], 3)
            if dedicated["rows_per_s"]
            else None,
            "others_during_drain": during,
            "others_committed_per_s_per_database": round(writers.rate_reached(), 2),
        }
        if without and during["p99_ms"] is not None:
            result["others_without_backlog_p99_ms"] = without
            result["p99_ratio"] = round(during["p99_ms"] / without, 2)
        return result

    def _drain(self, relays: RelayProcesses) -> dict[str, Any]:
        """Commit the backlog in the first database (to the backlog's own queue) and
        wait until the queue holds every row."""
        rows = self.o.backlog
        broker = self.backlog_broker
        broker.purge()
        with session.connect(self.fleet.dsns[0], application_name="outbox-bench") as conn:
            with conn.transaction():
                conn.execute(
                    'INSERT INTO "outbox" (exchange, routing_key, payload) '
                    "SELECT %s, 'backlog', convert_to(rpad(i::text || ':', %s, 'x'), 'UTF8') "
                    "FROM generate_series(1, %s) AS i",
                    [broker.exchange, self.o.payload, rows],
                )
            committed = time.perf_counter()
            deadline = time.monotonic() + max(600.0, rows / 100)
            while True:
                depth = broker.depth()
                if depth >= rows:
                    delivered = time.perf_counter()
                    break
                if time.monotonic() > deadline:
                    raise OutboxError(f"the relay delivered {depth} of {rows} backlog rows")
                relays.check_alive()
                time.sleep(0.05)
            # The last batch is committed just after its messages were confirmed.
            for _ in range(200):
                row = conn.execute('SELECT count(*) AS n FROM "outbox"').fetchone()
                if row and row["n"] == 0:
                    break
                time.sleep(0.05)
        depth = broker.depth()
        self.lost += max(0, rows - depth)
        self.duplicates += max(0, depth - rows)
        broker.purge()
        seconds = delivered - committed
        return {
            "seconds": round(seconds, 2),
            "rows_per_s": round(rows / seconds) if seconds > 0 else 0,
            "delivered": depth,
            "committed_at": committed,
        }

    def change(self) -> dict[str, Any]:
        """A database added to the targets file, then another removed, while every
        database is written."""
        names, dsns = self.fleet.names, self.fleet.dsns
        if len(dsns) < 3:
            raise OutboxError("the change run needs 3 databases at least")
        self.echo(
            f"  change: {len(dsns) - 1} targets, then the last database added, then the "
            "first removed ..."
        )
        added, removed = len(dsns) - 1, 0
        targets = TargetsFile(self.dir, dsns[:added])
        relays = fleet_relays(self.settings(), targets, 1, self.o.dormant_after)
        try:
            wait_serving(self.fleet, range(added), relays)
            with arrivals(self.o.amqp_url, self.broker.queue) as receiver:
                writers = Writers(
                    self.fleet, self.all(), self.broker.exchange, self.o, seconds=None
                )
                try:
                    time.sleep(max(0.0, writers.start + WARMUP_SECONDS - time.perf_counter()))
                    added_at = targets.write(dsns)
                    first = self._first_arrival(receiver, names[added], added_at, relays)
                    time.sleep(max(1.0, self.o.seconds / 2))
                    removed_at = targets.write(dsns[1:])
                    # The source looks at the file every 5 s: a gap, if any, is there.
                    time.sleep(max(10.0, self.o.seconds / 2))
                    window_end = time.perf_counter()
                finally:
                    writers.stop()
                    writers.join(timeout=120)
                # Everything committed arrives: the removed database served again.
                readded_at = targets.write(dsns)
                self._account(wait_arrived(writers, receiver), receiver)
        finally:
            relays.stop()
        window_start = writers.start + WARMUP_SECONDS

        def largest_gap(since: float, until: float) -> tuple[float, str]:
            """The longest pause between two deliveries of one of the others."""
            gaps = []
            for i in range(1, added):
                times = [t for t in receiver.by_key.get(names[i], []) if since <= t <= until]
                pauses = [b - a for a, b in itertools.pairwise(times)]
                gaps.append((max(pauses, default=math.inf), names[i]))
            return max(gaps)

        gap, worst = largest_gap(window_start, window_end)
        gap_before, _ = largest_gap(window_start, removed_at)
        gap_after, _ = largest_gap(removed_at, window_end)
        # Until when the removed database was still served (its last delivery before
        # it was added back).
        served = [t for t in receiver.by_key.get(names[removed], []) if t < readded_at]
        return {
            "added": names[added],
            "added_first_row_s": None if first is None else round(first, 2),
            "removed": names[removed],
            "removed_after_s": round(removed_at - added_at, 1),
            "others": added - 1,
            "others_max_gap_s": round(gap, 3),
            "others_max_gap_database": worst,
            "others_max_gap_before_removal_s": round(gap_before, 3),
            "others_max_gap_after_removal_s": round(gap_after, 3),
            "others_expected_gap_s": round(1 / self.o.rate, 3),
            "window_s": round(window_end - window_start, 1),
            "removed_last_delivery_s": round(max(served) - removed_at, 2) if served else None,
        }

    def _first_arrival(
        self, receiver: Arrivals, key: str, since: float, relays: RelayProcesses
    ) -> float | None:
        """Seconds from ``since`` until the first message of ``key`` arrived (None:
        not within 60 s)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            times = receiver.by_key.get(key)
            if times:
                return times[0] - since
            relays.check_alive()
            time.sleep(0.05)
        return None


def _public(drain: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in drain.items() if k != "committed_at"}


def run_fleet_bench(options: FleetOptions, echo: Echo) -> dict[str, Any]:
    """The runs ``options.runs`` asks for; returns the figures."""
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count()},
        "databases": options.databases,
        "rate_per_database": options.rate,
        "seconds": options.seconds,
        "payload": options.payload,
        "runs": list(options.runs),
    }
    with fleet_databases(options.dsn, options.databases, echo) as fleet:
        report["machine"]["postgres"] = fleet.description
        report["max_connections"] = fleet.max_connections
        bench = FleetBench(options, fleet, echo)
        try:
            _runs(bench, options.runs, report)
        except OutboxError as exc:
            # The figures so far are kept; the run that failed says why.
            report["failed"] = str(exc)
            echo(f"  failed: {exc}")
        finally:
            bench.close()
    base = report.get("baseline")
    for name in ("one", "two"):
        if base and name in report and base["p99_ms"] and report[name]["p99_ms"]:
            report[name]["p99_ratio_to_baseline"] = round(
                report[name]["p99_ms"] / base["p99_ms"], 2
            )
    if "baseline" in report and "idle" in report:
        single = report["baseline"]["relay"]["rss_mib"]
        report["idle"]["single_database_relays_rss_mib"] = round(single * options.databases, 1)
    report["lost"] = bench.lost
    report["duplicates"] = bench.duplicates
    report["every_row_arrived"] = bench.lost == 0 and "failed" not in report
    return report


def _runs(bench: FleetBench, runs: Sequence[str], report: dict[str, Any]) -> None:
    if "baseline" in runs:
        report["baseline"] = bench.baseline()
    if "one" in runs:
        report["one"] = bench.fleet_run(1)
    if "two" in runs:
        report["two"] = bench.fleet_run(2, then_idle="idle" in runs)
        if "idle" in runs:
            report["idle"] = report["two"].pop("idle")
    elif "idle" in runs:
        report["idle"] = bench.idle()
    if "backlog" in runs:
        report["backlog"] = bench.backlog(report.get("one", {}).get("others_p99_ms"))
    if "change" in runs:
        report["change"] = bench.change()


def render(report: dict[str, Any]) -> str:
    """The figures as text (Markdown tables)."""
    lines = [
        f"many databases: {report['databases']} databases on one PostgreSQL "
        f"({report['machine']['postgres']}, max_connections = {report['max_connections']}), "
        f"{report['rate_per_database']:g} rows/s per database, {report['payload']} B "
        f"payloads, {report['seconds']:g} s measured per run",
    ]
    written = [
        ("baseline: 1 database, `outbox relay`", report.get("baseline")),
        (f"{report['databases']} databases, 1 fleet relay", report.get("one")),
        (f"{report['databases']} databases, 2 fleet relays", report.get("two")),
    ]
    if any(run for _, run in written):
        lines += [
            "",
            "| run | rows/s per database reached | p50 | p99 | p99 of the worst database "
            "| p99 vs baseline | relay CPU | relay RSS | relay sessions | machine busy |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for label, run in written:
            if not run:
                continue
            rss = _sum_of(m["rss_mib"] for m in run.get("relay_memory") or [run["relay"]])
            ratio = run.get("p99_ratio_to_baseline")
            cpu = run.get("relay_cpu_percent_of_a_core")
            per_row = run.get("relay_cpu_ms_per_row")
            lines.append(
                f"| {label} | {run['committed_per_s_per_database']:g} | {_ms(run['p50_ms'])} "
                f"| {_ms(run['p99_ms'])} | {_ms(run['database_p99_ms']['max'])} | "
                f"{'-' if ratio is None else f'{ratio:.2f}x'} | "
                f"{'-' if cpu is None else f'{cpu:g}% of a core'}"
                f"{'' if per_row is None else f', {per_row:g} ms per row'} | "
                f"{rss} MiB | "
                f"{_sum_of(run.get('sessions_per_relay') or [run['relay']['sessions']])} | "
                f"{run.get('machine_busy_percent')}% |"
            )
    idle = report.get("idle")
    if idle:
        lines += [
            "",
            f"idle ({report['databases']} databases, no writes, {idle['relays']} fleet "
            f"relays, dormant): over {idle['seconds']:g} s, CPU "
            f"{_sum_of(idle['cpu_percent_of_a_core'])}% of a core; "
            f"sessions per database per relay {idle['sessions_per_database_per_relay_mean']:g} "
            f"(at most {idle['sessions_per_database_per_relay_max']}), "
            f"{idle['sessions_total']} in all of max_connections = {idle['max_connections']}; "
            f"RSS {_sum_of(m['rss_mib'] for m in idle['relay_memory'])} MiB"
            + (
                f" (one single-database relay x {report['databases']}: "
                f"{idle['single_database_relays_rss_mib']:g} MiB)"
                if "single_database_relays_rss_mib" in idle
                else ""
            ),
            f"  then one row in every dormant database: p50 {_ms(idle['wake_up']['p50_ms'])}, "
            f"p99 {_ms(idle['wake_up']['p99_ms'])}, max {_ms(idle['wake_up']['max_ms'])}",
        ]
    backlog = report.get("backlog")
    if backlog:
        ratio = backlog.get("p99_ratio")
        lines += [
            "",
            f"backlog of {backlog['rows']:,} rows in one database: a dedicated relay drains "
            f"{backlog['dedicated']['rows_per_s']:,} rows/s, one fleet relay "
            f"{backlog['fleet']['rows_per_s']:,} rows/s while the others are written "
            f"({backlog['drain_ratio']}x)",
            f"  the other databases meanwhile: p50 "
            f"{_ms(backlog['others_during_drain']['p50_ms'])}, "
            f"p99 {_ms(backlog['others_during_drain']['p99_ms'])}"
            + (
                ""
                if ratio is None
                else f" ({ratio:.2f}x their {backlog['others_without_backlog_p99_ms']:.1f} ms "
                "without the backlog)"
            )
            + f", {backlog['others_committed_per_s_per_database']:g} rows/s per database reached",
        ]
    change = report.get("change")
    if change:
        first = change["added_first_row_s"]
        lines += [
            "",
            f"targets changed while running: {change['added']} added, its first row arrived "
            f"{'never (60 s)' if first is None else f'{first:g} s'} after the file changed; "
            f"{change['removed']} removed {change['removed_after_s']:g} s later (its last "
            f"delivery {_seconds(change['removed_last_delivery_s'])} after the file changed); "
            "the other "
            f"{change['others']} databases' longest gap between deliveries "
            f"{change['others_max_gap_s']:g} s ({change['others_max_gap_database']}; "
            f"{change['others_max_gap_before_removal_s']:g} s before the removal, "
            f"{change['others_max_gap_after_removal_s']:g} s after; "
            f"a row every {change['others_expected_gap_s']:g} s) over {change['window_s']:g} s",
        ]
    if "failed" in report:
        lines += ["", f"FAILED: {report['failed']}"]
    lines += [
        "",
        "every row arrived"
        + (f" ({report['duplicates']} duplicates)" if report["duplicates"] else " exactly once")
        if report["every_row_arrived"]
        else f"{report['lost']} ROWS DID NOT ARRIVE",
    ]
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:g} s"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _sum_of(values: Iterable[float]) -> str:
    """``12.5 + 13`` (one figure per relay)."""
    return " + ".join(f"{value:g}" for value in values)
