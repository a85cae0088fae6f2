"""The ``outbox bench`` harness: servers, relays, the bare publisher, one run.

What every scenario of ``outbox bench`` shares (``run`` is the entry point, the
scenarios are ``load``, ``ordering``, ``memory`` and ``consume``):

- ``bare_publish``: a competent hand-written pika publisher (persistent messages,
  ``mandatory``, publisher confirms pipelined over a sliding window), the baseline;
- ``BenchTopology``: a private exchange and queue per bench run; ``Receiver``: the
  latency consumer;
- ``RelayProcesses``: relays as subprocesses (``python -m outbox relay``), exactly
  as deployed: each gets its own interpreter and GIL, so 2 or 4 relays measure the
  design rather than Python threads fighting over one GIL, and the bench's own
  consumer and polling do not steal the relay's CPU time;
- ``bench_database``: the configured server, or a private cluster with fsync on;
- ``Bench``: one throughput run (bare or relays draining a backlog), the latency
  run and the idle run.  Startup (imports, connecting) is kept out of the figures:
  relays are started and registered before the rows are committed, and the clock
  starts when that commit returns (the NOTIFY wakes them).

This module imports pika directly (the only one besides ``outbox.amqp.publisher``):
the baseline must be a plain pika publisher, not our ``Publisher``, and the latency
consumer must be as thin as possible.  Benchmarks print figures; nothing here is a
timed assertion.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pika
from pika.adapters.select_connection import SelectConnection
from psycopg import pq

from outbox.bench import memory as bench_memory
from outbox.config import Settings
from outbox.db import migrate, session
from outbox.db.devcluster import PostgresCluster
from outbox.errors import OutboxError
from outbox.tables import function_names, table_names

Echo = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    amqp_url: str
    dsn: str | None = None
    rows: int = 20_000
    payload: int = 1024
    repeats: int = 3
    relays: tuple[int, ...] = (1, 2, 4)
    batch_sizes: tuple[int, ...] = (100, 1000, 5000)
    window: int = 1000
    latency_rate: float = 200.0
    latency_seconds: float = 5.0
    idle_seconds: float = 12.0
    burst_writers: int = 8
    burst_rows: int = 250
    burst_pause: float = 1.5
    scaling: bool = True  # the relays x batch sizes grid
    bursts: bool = True  # the bursty-writers load shape
    ordering: bool = True  # unordered / 1,000 keys / one hot key
    memory: bool = True  # the relay's peak RSS draining large rows
    latency: bool = True  # the latency run and the idle run
    latency_rounds: int = 1  # relay and poller runs, alternated (``Bench.latency``)
    latency_only: bool = False  # nothing else (no idle run either)
    memory_only: bool = False  # nothing else
    memory_backlogs: tuple[bench_memory.Backlog, ...] = bench_memory.parse_backlogs(
        bench_memory.DEFAULT_BACKLOGS
    )


# -- the bare publisher -------------------------------------------------------------
def bare_publish(
    amqp_url: str,
    exchange: str,
    routing_key: str,
    bodies: Sequence[bytes],
    message_ids: Sequence[str],
    *,
    window: int = 1000,
    timeout: float = 120.0,
) -> float:
    """Publish every body (persistent, mandatory) with at most ``window`` unconfirmed.

    Returns the seconds from the first publish to the last confirm.  This is what a
    competent hand-written pika publisher does; the relay is measured against it.
    """
    started, finished = bare_publish_span(
        amqp_url, exchange, routing_key, bodies, message_ids, window=window, timeout=timeout
    )
    return finished - started


def bare_publish_span(
    amqp_url: str,
    exchange: str,
    routing_key: str,
    bodies: Sequence[bytes],
    message_ids: Sequence[str],
    *,
    window: int = 1000,
    timeout: float = 120.0,
    ready: Callable[[], None] | None = None,
) -> tuple[float, float]:
    """``bare_publish``, returning when (``time.perf_counter``) the first publish
    went out and the last confirm came; ``ready`` is called once the channel is in
    confirm mode, before the first publish (``publishers`` waits there for the
    others to be connected too)."""
    state: dict[str, Any] = {"sent": 0, "acked": 0, "nacked": 0, "returned": 0}
    outstanding: dict[int, None] = {}
    conn_ref: list[SelectConnection] = []
    total = len(bodies)
    started = [0.0]

    def pump(channel: Any) -> None:
        while state["sent"] < total and len(outstanding) < window:
            i = state["sent"]
            props = pika.BasicProperties(delivery_mode=2, message_id=message_ids[i])
            channel.basic_publish(exchange, routing_key, bodies[i], props, mandatory=True)
            state["sent"] = i + 1
            outstanding[i + 1] = None

    def on_confirm(frame: Any) -> None:
        method = frame.method
        tags = (
            [t for t in outstanding if t <= method.delivery_tag]
            if method.multiple
            else [method.delivery_tag]
        )
        for tag in tags:
            outstanding.pop(tag, None)
        key = "acked" if isinstance(method, pika.spec.Basic.Ack) else "nacked"
        state[key] += len(tags)
        if state["acked"] + state["nacked"] >= total:
            state["finished"] = time.perf_counter()
            conn_ref[0].close()
        else:
            pump(state["channel"])

    def on_channel(channel: Any) -> None:
        state["channel"] = channel
        channel.add_on_return_callback(lambda *_: state.__setitem__("returned", 1))

        def confirming(_frame: Any) -> None:
            if ready is not None:
                try:
                    ready()
                except Exception as exc:
                    state["error"] = f"{type(exc).__name__}: {exc}"
                    conn_ref[0].close()
                    return
            started[0] = time.perf_counter()
            pump(channel)

        channel.confirm_delivery(ack_nack_callback=on_confirm, callback=confirming)

    def on_closed(_conn: Any, _reason: Any) -> None:
        conn_ref[0].ioloop.stop()

    conn = SelectConnection(
        pika.URLParameters(amqp_url),
        on_open_callback=lambda c: c.channel(on_open_callback=on_channel),
        on_open_error_callback=lambda _c, err: on_closed(_c, err),
        on_close_callback=on_closed,
    )
    conn_ref.append(conn)
    timer = conn.ioloop.call_later(timeout, conn.ioloop.stop)
    conn.ioloop.start()
    conn.ioloop.remove_timeout(timer)
    if "finished" not in state or state["nacked"] or state["returned"]:
        raise OutboxError(f"bare publisher did not finish cleanly: {state}")
    return started[0], float(state["finished"])


# -- broker topology and the latency consumer ------------------------------------
class BenchTopology:
    """A private exchange and queue for one bench run, deleted afterwards."""

    def __init__(
        self, amqp_url: str, suffix: str, *, arguments: dict[str, Any] | None = None
    ) -> None:
        """``arguments``: the queue's (``x-queue-type``, ``x-delivery-limit``...)."""
        self.amqp_url = amqp_url
        self.exchange = f"outbox.bench.{suffix}"
        self.queue = f"outbox.bench.{suffix}"
        self.ledger = f"outbox.bench.ledger.{suffix}"
        # No heartbeats: a blocking connection sends them only when used, and this
        # one may sit idle for minutes while a long run goes on (the broker would
        # close it after two missed intervals).
        params = pika.URLParameters(amqp_url)
        params.heartbeat = 0
        self._conn = pika.BlockingConnection(params)
        self._channel = self._conn.channel()
        self._channel.exchange_declare(self.exchange, "topic", durable=True)
        self._channel.queue_declare(self.queue, durable=True, arguments=arguments)
        self._channel.queue_bind(self.queue, self.exchange, "#")

    def depth(self) -> int:
        frame = self._channel.queue_declare(self.queue, passive=True)
        return int(frame.method.message_count)

    def purge(self) -> None:
        self._channel.queue_purge(self.queue)

    def delete(self) -> None:
        with contextlib.suppress(Exception):
            self._channel.queue_delete(self.queue)
            self._channel.queue_delete(self.ledger)
            self._channel.exchange_delete(self.exchange)
        with contextlib.suppress(Exception):
            self._conn.close()


class Receiver(threading.Thread):
    """Consumes the bench queue and notes when each message id arrived."""

    def __init__(self, amqp_url: str, queue: str) -> None:
        super().__init__(daemon=True)
        self.arrived: dict[str, float] = {}
        self.duplicates = 0  # messages that arrived again (first arrival kept)
        self._amqp_url, self._queue = amqp_url, queue
        self._halt = threading.Event()
        self.ready = threading.Event()

    def run(self) -> None:
        conn = pika.BlockingConnection(pika.URLParameters(self._amqp_url))
        channel = conn.channel()
        channel.basic_qos(prefetch_count=1000)

        def on_message(_ch: Any, _method: Any, props: Any, _body: bytes) -> None:
            if props.message_id in self.arrived:
                self.duplicates += 1
            else:
                self.arrived[props.message_id] = time.perf_counter()

        channel.basic_consume(self._queue, on_message, auto_ack=True)
        self.ready.set()
        while not self._halt.is_set():
            conn.process_data_events(time_limit=0.05)
        conn.close()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)


# -- relays as subprocesses -----------------------------------------------------------
class RelayProcesses:
    """``count`` relay processes with the given settings (SIGTERM on exit)."""

    def __init__(
        self,
        settings: Settings,
        count: int,
        *,
        log_level: str = "warning",
        log_format: str = "text",
        extra_env: dict[str, str] | None = None,
        env_per_relay: Sequence[dict[str, str]] = (),
        log_dir: str | None = None,
        log_name: str = "relay",
        args: Sequence[str] = (),
        unset: Sequence[str] = (),
    ) -> None:
        """``env_per_relay``: relay n's own variables (a metrics port each, say);
        ``log_dir``: keep each relay's stderr there (``<log_name>-<n>.log``) for a
        reader after the run; otherwise it lives in an unnamed temporary file;
        ``args``: more options of ``outbox relay`` (``--targets FILE``); ``unset``:
        variables of ``settings`` left out (``OUTBOX_DSN`` beside ``--targets``)."""
        env = dict(os.environ)
        for field in dataclasses.fields(Settings):
            value = getattr(settings, field.name)
            env.pop(f"OUTBOX_{field.name.upper()}", None)
            if value is not None:  # None is the option's default, "None" a file name
                env[f"OUTBOX_{field.name.upper()}"] = str(value)
        env["OUTBOX_LOG_LEVEL"] = log_level
        env["OUTBOX_LOG_FORMAT"] = log_format
        env.update(extra_env or {})
        for name in unset:
            env.pop(name, None)
        self.log_paths: list[str] = []
        if log_dir is None:
            self._logs = [tempfile.TemporaryFile() for _ in range(count)]  # noqa: SIM115
        else:
            self.log_paths = [os.path.join(log_dir, f"{log_name}-{n}.log") for n in range(count)]
            # Appending: the relay's writes land at the end whatever the offset.
            self._logs = [open(path, "a+b") for path in self.log_paths]  # noqa: SIM115
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "outbox", "relay", *args],
                env={**env, **(env_per_relay[n] if n < len(env_per_relay) else {})},
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
            for n, log in enumerate(self._logs)
        ]

    def check_alive(self) -> None:
        for proc, log in zip(self.procs, self._logs, strict=True):
            if proc.poll() is not None:
                log.seek(0)
                text = log.read().decode(errors="replace")[-2000:]
                raise OutboxError(f"a bench relay exited with {proc.returncode}:\n{text}")

    def log_tail(self, chars: int = 4000) -> str:
        """The end of each relay's log so far (its stderr)."""
        tails = []
        for n, log in enumerate(self._logs):
            if log.closed:
                continue
            # pread: the relay writes through the same open file (and offset).
            size = os.fstat(log.fileno()).st_size
            start = max(0, size - chars)
            text = os.pread(log.fileno(), size - start, start).decode(errors="replace")
            tails.append(f"-- relay {n} (last {min(size, chars)} of {size} bytes) --\n{text}")
        return "\n".join(tails)

    def cpu_seconds(self) -> float:
        """User + system CPU of the relay processes so far."""
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0
        for proc in self.procs:
            with open(f"/proc/{proc.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / ticks

    def stop(self) -> list[dict[str, Any]]:
        """SIGTERM every relay; returns their ``relay.stopped`` events (JSON logs only)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        events = []
        for log in self._logs:
            log.seek(0)
            for line in log.read().decode(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    entry = json.loads(line)
                    if isinstance(entry, dict) and entry.get("event") == "relay.stopped":
                        events.append(entry)
            log.close()
        return events


class PollerProcess:
    """``python -m outbox.bench.poller``, the latency baseline, started and ready."""

    def __init__(self, dsn: str, table: str, amqp_url: str) -> None:
        env = dict(os.environ, OUTBOX_DSN=dsn, OUTBOX_TABLE=table, OUTBOX_AMQP_URL=amqp_url)
        self._log = tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "outbox.bench.poller"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        if not ready or self.proc.stdout.readline().strip() != b"ready":
            self._log.seek(0)
            text = self._log.read().decode(errors="replace")[-2000:]
            self.stop()
            raise OutboxError(f"the bench's poller did not start:\n{text}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


# -- the database ------------------------------------------------------------------
@dataclasses.dataclass
class Database:
    dsn: str  # where the relays and the bench's writes go
    stats_dsn: str  # where pg_stat_database is read from (another database if we can)
    table: str
    description: str


@contextlib.contextmanager
def bench_database(
    dsn: str | None, echo: Echo, *, server_settings: dict[str, str] | None = None
) -> Iterator[Database]:
    """The server given by ``dsn`` (a table of its own), or a private cluster with
    fsync on and ``server_settings`` (e.g. ``wal_level = logical``)."""
    suffix = uuid.uuid4().hex[:8]
    if dsn:
        table = f"outbox_bench_{suffix}"
        conn = session.connect(dsn, application_name="outbox-bench")
        try:
            migrate.migrate(conn, table)
            yield Database(dsn, dsn, table, "the server given by --dsn")
        finally:
            drop_outbox(conn, table)
            conn.close()
        return
    echo("starting a private PostgreSQL (fsync on, max_prepared_transactions = 64) ...")
    with PostgresCluster(durable=True, extra_settings=server_settings) as cluster:
        admin = session.connect(cluster.dsn, application_name="outbox-bench")
        admin.execute("CREATE DATABASE bench")
        admin.close()
        bench_dsn = cluster.dsn.rsplit("/", 1)[0] + "/bench"
        conn = session.connect(bench_dsn, application_name="outbox-bench")
        migrate.migrate(conn, "outbox")
        conn.close()
        yield Database(bench_dsn, cluster.dsn, "outbox", "private cluster, fsync on")


def drop_outbox(conn: session.Conn, table: str) -> None:
    """Drop a bench's outbox table, every table and function of it (best effort)."""
    for name in table_names(table):
        with contextlib.suppress(Exception):
            conn.execute(f'DROP TABLE IF EXISTS "{name}" CASCADE')
    for function in function_names(table):
        with contextlib.suppress(Exception):
            conn.execute(f'DROP FUNCTION IF EXISTS "{function}"()')


def fill(
    conn: session.Conn, table: str, exchange: str, rows: int, payload: int, keys: int | None = None
) -> None:
    """``rows`` rows; with ``keys``, row i has ordering key i mod keys."""
    conn.execute(
        f'INSERT INTO "{table}" (exchange, routing_key, payload, ordering_key) '
        "SELECT %s, 'bench.' || (i %% 16), "
        "convert_to(rpad(i::text || ':', %s, 'x'), 'UTF8'), "
        f"{ordering_key_sql('i', '%s')} "
        "FROM generate_series(1, %s) AS i",
        [exchange, payload, keys, keys, rows],
    )


def ordering_key_sql(index: str, keys: str) -> str:
    """The SQL of row ``index``'s ordering key when the rows share ``keys`` keys
    (NULL: no key), ``'key-' || index mod keys``: the keys every bench writes
    (``fill``'s backlog, ``horizon``'s writers).  ``keys`` appears twice, ``mod()``
    spares the caller escaping ``%``."""
    return f"CASE WHEN {keys}::int IS NOT NULL THEN 'key-' || mod({index}, {keys}::int) END"


def wait_registered(conn: session.Conn, table: str, count: int, relays: RelayProcesses) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        relays.check_alive()
        row = conn.execute(f'SELECT count(*) AS n FROM "{table}_relays"').fetchone()
        if row and row["n"] >= count:
            return
        time.sleep(0.05)
    raise OutboxError("bench relays did not register within 30 s")


# -- the runs ---------------------------------------------------------------------
def machine_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine so far (``/proc/stat``)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


# Commits per second asked of one producer session in the latency run (each waits
# for its WAL flush); a higher ``--latency-rate`` uses more sessions (processes).
PRODUCER_COMMITS_PER_S = 500


# Seconds the latency run's producer processes get to start before the first row
# is due.
PRODUCER_START_SECONDS = 3.0


def commit_rows(
    dsn: str,
    table: str,
    exchange: str,
    payload: int,
    rate: float,
    count: int,
    first: int,
    step: int,
    start: float,
    results: Any,
) -> None:
    """One latency producer (a process of its own): rows first, first + step, … of
    ``count``, row i committed at ``start + i / rate``; puts {message_id: when its
    COMMIT returned} on ``results`` (or the error, as text)."""
    committed: dict[str, float] = {}
    try:
        body = b"x" * payload
        with session.connect(dsn, application_name="outbox-bench-producer") as producer:
            # The producers stand for applications on other machines: what they cost
            # here is taken from the relay they measure.  So each commit is one call
            # of libpq's PQexecPrepared (psycopg's ``pq`` layer): the INSERT in
            # autocommit is its own transaction, one round trip, about a fifth of the
            # CPU of a psycopg ``execute`` inside BEGIN … COMMIT (three round trips),
            # with which the producers and their backends took more than half of
            # this machine's two cores at 2,000 commits/s.
            pgconn = producer.pgconn
            prepared = pgconn.prepare(
                b"bench_commit",
                f'INSERT INTO "{table}" (message_id, exchange, routing_key, payload) '
                "VALUES ($1::uuid, $2, 'bench.latency', $3::bytea)".encode(),
            )
            if prepared.status != pq.ExecStatus.COMMAND_OK:
                raise OutboxError(prepared.get_error_message())
            params = [b"", exchange.encode(), body]
            formats = [pq.Format.TEXT, pq.Format.TEXT, pq.Format.BINARY]
            for i in range(first, count, step):
                pause = start + i / rate - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                message_id = str(uuid.uuid4())
                params[0] = message_id.encode()
                result = pgconn.exec_prepared(b"bench_commit", params, formats)
                if result.status != pq.ExecStatus.COMMAND_OK:
                    raise OutboxError(result.get_error_message())
                committed[message_id] = time.perf_counter()
    except Exception as exc:
        results.put(f"{type(exc).__name__}: {exc}")
        return
    results.put(committed)


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU of a process of this machine so far (``/proc/<pid>/stat``),
    None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Backends:
    """The PostgreSQL backends serving the relays (work, control and wake-up
    sessions), read from ``/proc`` when the server runs on this machine."""

    def __init__(self, conn: session.Conn) -> None:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name LIKE 'outbox-relay%%'"
        ).fetchall()
        # A pid of a remote server may name an unrelated process here: only a local
        # postgres process counts.
        self.pids = [int(r["pid"]) for r in rows if is_postgres(int(r["pid"]))]
        self.local = bool(rows) and len(self.pids) == len(rows)

    def cpu_seconds(self) -> float | None:
        if not self.local:
            return None
        return sum(process_cpu_seconds(pid) or 0.0 for pid in self.pids)


def is_postgres(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().startswith(b"postgres")
    except OSError:
        return False


def bench_body(index: int, payload: int) -> bytes:
    """The bare publishers' ``index``-th body, ``payload`` bytes."""
    return f"{index}:".encode().ljust(payload, b"x")


# How often ``Bench.relay`` looks at the queue while the relays drain: at most every
# ``WATCH_MIN_SECONDS``, at least every ``WATCH_MAX_SECONDS``.
WATCH_MIN_SECONDS = 0.005
WATCH_MAX_SECONDS = 0.1


def watch_pause(delivered: int, rows: int, elapsed: float) -> float:
    """Seconds to wait before looking at the queue's depth again, ``delivered`` of
    ``rows`` messages being there after ``elapsed`` seconds: a quarter of the time
    the rest takes at the rate so far, within [``WATCH_MIN_SECONDS``,
    ``WATCH_MAX_SECONDS``].

    Each look is a ``queue.declare`` the broker answers and the bench's pika
    decodes.  One every 5 ms cost the bench 0.06 s of CPU per 10,000 messages
    beside 4 relays on 2 cores (a quarter of what the relays spent), plus the
    broker's, CPU the bare publishers it is compared with never pay for; so the
    bench looks often only near the end, where the drain's time is read: once the
    rest is due within 20 ms, every 5 ms, as before.
    """
    if delivered <= 0 or elapsed <= 0:
        return WATCH_MIN_SECONDS
    remaining = (rows - delivered) * elapsed / delivered
    return min(WATCH_MAX_SECONDS, max(WATCH_MIN_SECONDS, remaining / 4))


def per_10k(cpu_seconds: float | None, messages: int) -> float | None:
    """CPU seconds per 10,000 messages."""
    if cpu_seconds is None or messages <= 0:
        return None
    return cpu_seconds * 10_000 / messages


@dataclasses.dataclass
class Run:
    kind: str  # bare | parallel-bare | relay
    relays: int
    batch_size: int
    rows: int
    seconds: float
    delivered: int
    machine_busy: float = 0.0  # share of all CPUs busy during the run (0..1)
    # User + system CPU during the run: the relay processes (the bench's own process
    # for the bare publisher), and the relays' PostgreSQL backends (None: the server
    # is not on this machine; the bare publisher has none).
    cpu_seconds: float = 0.0
    backend_cpu_seconds: float | None = None

    @property
    def rate(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    @property
    def relay_cpu_seconds(self) -> float:
        return self.cpu_seconds

    @property
    def cpu_per_10k(self) -> float | None:
        """CPU seconds per 10,000 messages: the publishing process."""
        return per_10k(self.cpu_seconds, self.rows)

    @property
    def backend_cpu_per_10k(self) -> float | None:
        return per_10k(self.backend_cpu_seconds, self.rows)


class Bench:
    def __init__(
        self, options: BenchOptions, db: Database, broker: BenchTopology, echo: Echo
    ) -> None:
        self.o, self.db, self.broker, self.echo = options, db, broker, echo
        self.conn = session.connect(db.dsn, application_name="outbox-bench")
        self.bodies = [bench_body(i, options.payload) for i in range(options.rows)]

    def settings(self, batch_size: int | None = None) -> Settings:
        defaults = Settings()
        return Settings(
            dsn=self.db.dsn,
            amqp_url=self.o.amqp_url,
            table=self.db.table,
            ledger_queue=self.broker.ledger,
            batch_size=batch_size or defaults.batch_size,
        )

    def bare(self, *, window: int | None = None, rows_share: float = 1.0) -> Run:
        """The bare publisher (``window``: unconfirmed messages at most, default
        ``--window``) on ``rows_share`` of the bodies."""
        window = window or self.o.window
        bodies = self.bodies[: max(1, round(len(self.bodies) * rows_share))]
        ids = [str(uuid.uuid4()) for _ in bodies]
        self.broker.purge()
        # The bare publisher runs in this process, alone: its CPU is the process's.
        cpu0 = time.process_time()
        seconds = bare_publish(
            self.o.amqp_url,
            self.broker.exchange,
            "bench.bare",
            bodies,
            ids,
            window=window,
        )
        cpu = time.process_time() - cpu0
        run = Run("bare", 0, window, len(ids), seconds, self.broker.depth(), cpu_seconds=cpu)
        self.broker.purge()
        return run

    def relay(
        self,
        count: int,
        batch_size: int | None = None,
        *,
        keys: int | None = None,
        rows_share: float = 1.0,
    ) -> Run:
        """``count`` relays drain the backlog; ``keys``: its rows' ordering keys
        (``fill``), ``rows_share``: a share of ``--rows``."""
        settings = self.settings(batch_size)
        rows = max(1, round(self.o.rows * rows_share))
        self.broker.purge()
        # The table is left as the previous runs churned it (dead tuples, statistics
        # from whenever autovacuum last looked), as in production: no VACUUM here.
        relays = RelayProcesses(settings, count)
        try:
            wait_registered(self.conn, self.db.table, count, relays)
            backends = Backends(self.conn)
            # Read before the commit wakes the relays (idle, they cost next to nothing).
            cpu0, backend_cpu0 = relays.cpu_seconds(), backends.cpu_seconds()
            with self.conn.transaction():
                fill(self.conn, self.db.table, self.broker.exchange, rows, self.o.payload, keys)
            started = time.perf_counter()
            busy0, total0 = machine_ticks()
            deadline = time.monotonic() + 300
            # Watch the queue, not the table: a count(*) every 5 ms on the churned
            # table scans its dead tuples too (a whole core in one grid run, beside
            # the relays it measures).  The table is checked once the queue holds
            # every message.
            # The drain's time ends when the queue holds every message; the table's
            # count (which walks every dead row: 0.3 s and more behind a million,
            # ``outbox.bench.drain``) is not part of it.
            delivered: float | None = None
            while True:
                pause = WATCH_MIN_SECONDS
                if delivered is None:
                    depth = self.broker.depth()
                    if depth >= rows:
                        delivered = time.perf_counter()
                    else:
                        pause = watch_pause(depth, rows, time.perf_counter() - started)
                if delivered is not None:
                    row = self.conn.execute(
                        f'SELECT count(*) AS n FROM "{self.db.table}"'
                    ).fetchone()
                    if row and row["n"] == 0:
                        break
                if time.monotonic() > deadline:
                    raise OutboxError(
                        f"the relays delivered {self.broker.depth()} of {rows} messages in 300 s"
                    )
                relays.check_alive()
                time.sleep(pause)
            seconds = delivered - started
            busy1, total1 = machine_ticks()
            relay_cpu = relays.cpu_seconds() - cpu0
            backend_cpu1 = backends.cpu_seconds()
        finally:
            relays.stop()
        self.conn.execute(f'DELETE FROM "{self.db.table}_relays"')
        delivered = self.broker.depth()
        self.broker.purge()
        busy = (busy1 - busy0) / (total1 - total0) if total1 > total0 else 0.0
        backend_cpu = (
            backend_cpu1 - backend_cpu0
            if backend_cpu0 is not None and backend_cpu1 is not None
            else None
        )
        return Run(
            "relay",
            count,
            settings.batch_size,
            rows,
            seconds,
            delivered,
            busy,
            cpu_seconds=relay_cpu,
            backend_cpu_seconds=backend_cpu,
        )

    def latency(self) -> dict[str, Any]:
        """Commit → consumer at ``--latency-rate``: one relay (with its CPU, then its
        idle cost), and under the same producers the relay's loop without two-phase
        commit (``outbox.bench.poller``), the baseline that says what the guarantee
        costs on this machine, whatever else runs on it.

        ``--latency-rounds`` N: N rounds of both, alternated A B, B A, A B, … (so a
        drift of the machine's load hits both alike); the figures are the medians
        over the rounds, each round's ratio relay / poller is kept, and their
        medians are what to compare.  The idle run follows the first relay run
        (not with ``--latency-only``)."""
        rounds: list[dict[str, Any]] = []
        idle: dict[str, Any] | None = None
        for number in range(self.o.latency_rounds):
            kinds = ("relay", "poller") if number % 2 == 0 else ("poller", "relay")
            figures: dict[str, dict[str, Any]] = {}
            for kind in kinds:
                if kind == "poller":
                    figures[kind] = self._poller_latency()
                    continue
                measure_idle = number == 0 and not self.o.latency_only
                figures[kind], run_idle = self._relay_latency(idle=measure_idle)
                idle = idle or run_idle
            relay, poller = figures["relay"], figures["poller"]
            rounds.append(
                {
                    "relay": relay,
                    "poller": poller,
                    "ratio_p50": ratio_of(relay["p50_ms"], poller["p50_ms"]),
                    "ratio_p99": ratio_of(relay["p99_ms"], poller["p99_ms"]),
                    "first": kinds[0],
                }
            )
            if self.o.latency_rounds > 1:
                self.echo(f"  latency round {number + 1}: {round_line(rounds[-1])}")
        result = median_figures([r["relay"] for r in rounds])
        result["rate_per_s"] = self.o.latency_rate
        result["baseline"] = median_figures([r["poller"] for r in rounds])
        result["rounds"] = rounds
        result["ratio_p50_median"] = median_or_none([r["ratio_p50"] for r in rounds])
        result["ratio_p99_median"] = median_or_none([r["ratio_p99"] for r in rounds])
        result["idle"] = idle
        return result

    def _relay_latency(self, *, idle: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """One relay's latency run, with its CPU; then, if ``idle``, its idle run."""
        receiver = self._fresh_receiver()
        relays = RelayProcesses(self.settings(), 1)
        idle_figures = None
        try:
            wait_registered(self.conn, self.db.table, 1, relays)
            time.sleep(0.5)
            backends = Backends(self.conn)
            cpu0, backend_cpu0 = relays.cpu_seconds(), backends.cpu_seconds()
            committed, committed_rate, busy = self._commit_and_receive(receiver)
            relay_cpu = relays.cpu_seconds() - cpu0
            backend_cpu1 = backends.cpu_seconds()
            if idle:
                idle_figures = self._idle(relays)
        finally:
            relays.stop()
            receiver.stop()
        self.conn.execute(f'DELETE FROM "{self.db.table}_relays"')
        result = latency_figures(committed, committed_rate, receiver.arrived)
        result["machine_busy_percent"] = busy
        result["relay_cpu_s_per_10k"] = _rounded(per_10k(relay_cpu, len(committed)))
        result["backend_cpu_s_per_10k"] = _rounded(
            per_10k(
                backend_cpu1 - backend_cpu0
                if backend_cpu0 is not None and backend_cpu1 is not None
                else None,
                len(committed),
            )
        )
        return result, idle_figures

    def _poller_latency(self) -> dict[str, Any]:
        receiver = self._fresh_receiver()
        poller = PollerProcess(self.db.dsn, self.db.table, self.o.amqp_url)
        try:
            time.sleep(0.5)
            committed, committed_rate, busy = self._commit_and_receive(receiver)
        finally:
            poller.stop()
            receiver.stop()
        result = latency_figures(committed, committed_rate, receiver.arrived)
        result["machine_busy_percent"] = busy
        return result

    def _fresh_receiver(self) -> Receiver:
        """An empty outbox and queue, and a consumer noting arrivals on it."""
        self.broker.purge()
        self.conn.execute(f'TRUNCATE "{self.db.table}"')
        receiver = Receiver(self.o.amqp_url, self.broker.queue)
        receiver.start()
        receiver.ready.wait(10)
        return receiver

    def _commit_and_receive(self, receiver: Receiver) -> tuple[dict[str, float], float, float]:
        """Commit the latency run's rows and wait (10 s at most) for them to arrive;
        returns when each commit returned, by message id, the rate reached and how
        busy the machine's CPUs were meanwhile (percent of all, the producers'
        start included)."""
        count = max(1, int(self.o.latency_rate * self.o.latency_seconds))
        committed: dict[str, float] = {}
        busy0, total0 = machine_ticks()
        # On a busy machine the producers may fall behind the rate: said in the report.
        committed_rate = self._commit_at_rate(count, committed)
        busy1, total1 = machine_ticks()
        deadline = time.monotonic() + 10
        while len(receiver.arrived) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        busy = 100 * (busy1 - busy0) / (total1 - total0) if total1 > total0 else 0.0
        return committed, committed_rate, round(busy, 1)

    def _commit_at_rate(self, count: int, committed: dict[str, float]) -> float:
        """Commit ``count`` single-row transactions at ``--latency-rate``, noting when
        each commit returned; returns the rate reached.

        One session commits at most once per WAL flush (about 1 ms with fsync on
        here): alone it could not reach 2,000 commits/s.  So row i is due at
        ``start + i / rate`` and committed by session i mod n, each in a process of
        its own, as application processes would: producer threads in this process
        would hold the GIL that the receiver needs to timestamp arrivals.  Both read
        the same clock (``time.perf_counter``: CLOCK_MONOTONIC, the machine's)."""
        sessions = max(1, math.ceil(self.o.latency_rate / PRODUCER_COMMITS_PER_S))
        context = multiprocessing.get_context("spawn")  # no fork of a threaded process
        results = context.Queue()
        # Room for the producers to start (imports, connecting) before the first is due.
        start = time.perf_counter() + PRODUCER_START_SECONDS
        job = (self.db.dsn, self.db.table, self.broker.exchange, self.o.payload)
        producers = [
            context.Process(
                target=commit_rows,
                args=(*job, self.o.latency_rate, count, first, sessions, start, results),
                daemon=True,
            )
            for first in range(sessions)
        ]
        for producer in producers:
            producer.start()
        try:
            for _ in producers:
                outcome = results.get(timeout=PRODUCER_START_SECONDS + 60 + count / 100)
                if isinstance(outcome, str):
                    raise OutboxError(f"a latency producer failed: {outcome}")
                committed.update(outcome)
        finally:
            for producer in producers:
                producer.join(timeout=10)
                if producer.is_alive():
                    producer.kill()
        last = max(committed.values(), default=start)
        return count / (last - start) if last > start else 0.0

    def _idle(self, relays: RelayProcesses) -> dict[str, Any]:
        """The relay with nothing to do: CPU and database transactions per second."""
        self.conn.close()  # our own session must not count
        stats = session.connect(self.db.stats_dsn, application_name="outbox-bench-stats")
        dbname = session.connect(self.db.dsn, application_name="outbox-bench-stats")
        name = dbname.info.dbname
        dbname.close()

        def xacts() -> int:
            row = stats.execute(
                "SELECT (xact_commit + xact_rollback)::bigint AS n "
                "FROM pg_stat_database WHERE datname = %s",
                [name],
            ).fetchone()
            return int(row["n"]) if row else 0

        # A busy backend reports its counters at most once a second, and the last
        # ones up to 10 s after it goes idle (PGSTAT_IDLE_INTERVAL): let the latency
        # run's tail arrive before the window opens.
        time.sleep(11.0)
        own = 1 if self.db.stats_dsn == self.db.dsn else 0
        cpu0, tx0, t0 = relays.cpu_seconds(), xacts(), time.perf_counter()
        time.sleep(self.o.idle_seconds)
        cpu1, t1 = relays.cpu_seconds(), time.perf_counter()
        time.sleep(1.0)
        tx1 = xacts()
        stats.close()
        self.conn = session.connect(self.db.dsn, application_name="outbox-bench")
        seconds = t1 - t0
        return {
            "seconds": round(seconds, 1),
            "cpu_percent_of_a_core": round(100 * (cpu1 - cpu0) / seconds, 3),
            "db_transactions_per_s": round(max(0, tx1 - tx0 - own) / seconds, 3),
        }

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()


def _rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def latency_figures(
    committed: dict[str, float], committed_rate: float, arrived: dict[str, float]
) -> dict[str, Any]:
    """Percentiles of commit → arrival, in ms, and how many arrived."""
    latencies = sorted((arrived[m] - t) * 1000 for m, t in committed.items() if m in arrived)
    result: dict[str, Any] = {
        "committed_per_s": round(committed_rate),
        "sent": len(committed),
        "delivered": sum(1 for m in committed if m in arrived),
    }
    for q in (50, 95, 99):
        result[f"p{q}_ms"] = round(percentile(latencies, q), 2)
    result["max_ms"] = round(latencies[-1], 2) if latencies else None
    return result


def ratio_of(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator`` to three places; None without a denominator."""
    if numerator is None or not denominator or math.isnan(denominator):
        return None
    return round(numerator / denominator, 3)


def median_or_none(values: Sequence[float | None]) -> float | None:
    """The median of the known values, None if there is none."""
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def median_figures(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several latency runs as one: each figure the median over the runs (counts
    summed), so that one round gives its own figures back."""
    result: dict[str, Any] = {
        "sent": sum(r["sent"] for r in runs),
        "delivered": sum(r["delivered"] for r in runs),
    }
    for key in sorted({k for r in runs for k in r} - {"sent", "delivered"}):
        result[key] = median_or_none([r.get(key) for r in runs])
    if "committed_per_s" in result and result["committed_per_s"] is not None:
        result["committed_per_s"] = round(result["committed_per_s"])
    return result


def round_line(r: dict[str, Any]) -> str:
    """One latency round: the relay's and the poller's p50/p99 and the ratios."""
    relay, poller = r["relay"], r["poller"]

    def x(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    return (
        f"relay p50 {relay['p50_ms']} / p99 {relay['p99_ms']} ms, "
        f"poller p50 {poller['p50_ms']} / p99 {poller['p99_ms']} ms: "
        f"{x(r['ratio_p50'])} at p50, {x(r['ratio_p99'])} at p99 "
        f"({relay['committed_per_s']} / {poller['committed_per_s']} commits/s, "
        f"machine {relay.get('machine_busy_percent', '-')}% / "
        f"{poller.get('machine_busy_percent', '-')}% busy, {r['first']} first)"
    )


def percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]
