"""``outbox bench --soak``: hours of steady load with a fault every few minutes.

An application commits ``rate`` rows/s (``rows_per_commit`` rows per transaction)
for ``seconds`` while one relay with default settings runs against servers of the
soak's own: a private PostgreSQL cluster (fsync on) and a private RabbitMQ node,
both restarted during the run.  Every ``fault_interval`` (a twelfth of the run, 5
minutes of an hour, at least ``MIN_FAULT_INTERVAL``) comes the next fault, in turn:

1. ``relay-kill``: the relay is killed (SIGKILL) and a new one started;
2. ``broker-restart``: the RabbitMQ node is stopped and started again;
3. ``postgres-restart``: PostgreSQL is restarted (``pg_ctl restart -m fast``:
   sessions end, prepared batches stay);
4. ``snapshot``: a REPEATABLE READ transaction reads the outbox and stays open for
   a sixth of the run (10 minutes of an hour), holding the MVCC horizon.

Per window (a twelfth of the run unless ``window_seconds`` is given): commit →
delivery latency p50/p99 (by commit time), throughput (messages first received in
the window), the relay's RSS and open files (``/proc``), the outbox's dead rows.
At the end, after the writers stop and the backlog drains: every committed row
arrived (a COMMIT whose session PostgreSQL's restart cut is looked up with
``pg_xact_status`` once the server is back), nothing was left
in the outbox or prepared, and duplicates are within the bound: each fault may
duplicate what the relay had in flight (two batches, pipelined).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pika

from outbox.amqp.devnode import RabbitNode
from outbox.bench.harness import PRODUCER_START_SECONDS, RelayProcesses, percentile
from outbox.config import Settings
from outbox.db import migrate, session
from outbox.db.devcluster import PostgresCluster
from outbox.db.horizon import HorizonReader
from outbox.errors import OutboxError

FAULTS = ("relay-kill", "broker-restart", "postgres-restart", "snapshot")

# Faults come at most this often (seconds), however short the soak: a broker takes
# seconds to restart.
MIN_FAULT_INTERVAL = 6.0

# After the writers stop, how long the soak waits for the backlog to drain.
DRAIN_SECONDS = 180.0


@dataclasses.dataclass(frozen=True)
class SoakOptions:
    seconds: float = 3600.0
    window_seconds: float | None = None  # None: a twelfth of the run
    rate: float = 1000.0
    rows_per_commit: int = 10
    payload: int = 200

    @property
    def window(self) -> float:
        return self.window_seconds or self.seconds / 12

    @property
    def fault_interval(self) -> float:
        return max(MIN_FAULT_INTERVAL, self.seconds / 12)

    @property
    def snapshot_seconds(self) -> float:
        return self.seconds / 6


def fault_schedule(seconds: float, interval: float) -> list[tuple[float, str]]:
    """(seconds into the run, fault), the faults in turn every ``interval``; none in
    the last half interval, so the last one is seen to recover (pure)."""
    events = []
    k = 1
    while k * interval < seconds - interval / 2:
        events.append((k * interval, FAULTS[(k - 1) % len(FAULTS)]))
        k += 1
    return events


# -- the application: commits at a fixed rate, reconnecting ------------------------------
def produce(
    dsn: str,
    table: str,
    exchange: str,
    o: SoakOptions,
    start: float,
    results: Any,
) -> None:
    """Commit ``rows_per_commit`` rows at a fixed rate until ``start + seconds``.

    A session lost during the COMMIT leaves its outcome unknown: after reconnecting,
    ``pg_xact_status`` of the transaction's id says whether it committed.  Puts
    {"committed": {message_id: commit time}, "committed_unseen": [ids whose commit
    was confirmed only afterwards], "failed": n rows never committed, "reconnects": n}.
    """
    committed: dict[str, float] = {}
    committed_unseen: list[str] = []
    failed = reconnects = 0
    commits_per_s = o.rate / o.rows_per_commit
    until = start + o.seconds
    conn: session.Conn | None = None
    statement = (
        f'INSERT INTO "{table}" (message_id, exchange, routing_key, payload) '
        "SELECT m, %s, 'bench.soak', %s FROM unnest(%s::uuid[]) AS m"
    )
    body = b"x" * o.payload
    i = 0
    try:
        while True:
            due = start + i / commits_per_s
            if due >= until:
                break
            pause = due - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            i += 1
            ids = [str(uuid.uuid4()) for _ in range(o.rows_per_commit)]
            xid: str | None = None
            try:
                if conn is None:
                    conn = session.connect(dsn, application_name="outbox-bench-producer")
                with conn.transaction():
                    conn.execute(statement, [exchange, body, ids])
                    row = conn.execute("SELECT pg_current_xact_id()::text AS xid").fetchone()
                    xid = row["xid"] if row else None
            except Exception:
                reconnects += 1
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.close()
                conn = None
                if xid is not None and xact_committed(dsn, xid):
                    committed_unseen.extend(ids)
                else:
                    failed += len(ids)
                continue
            now = time.perf_counter()
            for message_id in ids:
                committed[message_id] = now
    except Exception as exc:
        results.put(f"{type(exc).__name__}: {exc}")
        return
    finally:
        if conn is not None:
            conn.close()
    results.put(
        {
            "committed": committed,
            "committed_unseen": committed_unseen,
            "failed": failed,
            "reconnects": reconnects,
        }
    )


def xact_committed(dsn: str, xid: str, wait: float = 60.0) -> bool:
    """Whether transaction ``xid`` committed, asked once PostgreSQL is back."""
    deadline = time.monotonic() + wait
    while True:
        try:
            with session.connect(dsn, application_name="outbox-bench-producer") as conn:
                row = conn.execute("SELECT pg_xact_status(%s::xid8) AS status", [xid]).fetchone()
                return bool(row and row["status"] == "committed")
        except OutboxError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


# -- the consumer: survives broker restarts -----------------------------------------------
class SoakReceiver(threading.Thread):
    """Consumes the soak queue with acks, reconnecting after a broker restart.

    A message the broker redelivers to us (``redelivered``: we had it and had not
    acked it when the connection dropped) is our own doing, not the relay's: only a
    repeat that is not a redelivery counts as a duplicate."""

    def __init__(self, rabbit: RabbitNode, queue: str) -> None:
        super().__init__(daemon=True)
        self.rabbit, self.queue = rabbit, queue
        self.arrived: dict[str, float] = {}
        self.duplicates = 0
        self.redelivered = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                conn = pika.BlockingConnection(pika.URLParameters(self.rabbit.url))
            except pika.exceptions.AMQPError:
                time.sleep(0.5)
                continue
            try:
                channel = conn.channel()
                channel.basic_qos(prefetch_count=1000)
                channel.basic_consume(self.queue, self._on_message)
                while not self._halt.is_set():
                    conn.process_data_events(time_limit=0.05)
                conn.close()
            except pika.exceptions.AMQPError:
                time.sleep(0.5)

    def _on_message(self, channel: Any, method: Any, props: Any, _body: bytes) -> None:
        message_id = props.message_id
        if message_id in self.arrived:
            if method.redelivered:
                self.redelivered += 1
            else:
                self.duplicates += 1
        else:
            self.arrived[message_id] = time.perf_counter()
        channel.basic_ack(method.delivery_tag)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=15)


# -- the relay, killed and restarted ----------------------------------------------------------
class Relay:
    """One relay process at a time; ``kill`` (-9) starts the next."""

    def __init__(self, settings: Settings, log_dir: str) -> None:
        """``log_dir``: where each relay's log is kept (``relay-<k>-0.log``, k the
        number of relays killed before it), to read after a stall or a failure."""
        self.settings = settings
        self.log_dir = log_dir
        self._lock = threading.Lock()
        self.killed = 0
        self.current = self._start()

    def _start(self) -> RelayProcesses:
        return RelayProcesses(
            self.settings,
            1,
            log_level="info",
            log_format="json",
            log_dir=self.log_dir,
            log_name=f"relay-{self.killed}",
        )

    def kill(self) -> None:
        with self._lock:
            self.current.procs[0].kill()
            self.current.procs[0].wait()
            self.current.stop()
            self.killed += 1
            self.current = self._start()

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the running relay's log."""
        with self._lock:
            return self.current.log_tail(chars)

    def process_figures(self) -> tuple[int | None, int | None]:
        """(RSS bytes, open files) of the running relay; None if it is gone."""
        with self._lock:
            pid = self.current.procs[0].pid
        try:
            with open(f"/proc/{pid}/status") as status:
                rss = next(
                    int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:")
                )
            return rss, len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, StopIteration):
            return None, None

    def check_alive(self) -> None:
        with self._lock:
            self.current.check_alive()

    def stop(self) -> list[dict[str, Any]]:
        with self._lock:
            return self.current.stop()


# -- the run ------------------------------------------------------------------------------
@contextlib.contextmanager
def soak_servers(echo: Any) -> Iterator[tuple[PostgresCluster, str, RabbitNode]]:
    echo("starting a private PostgreSQL (fsync on) and a private RabbitMQ node ...")
    rabbit = RabbitNode(prefix="obxsoak")
    try:
        rabbit.start()
        with PostgresCluster(durable=True) as cluster:
            admin = session.connect(cluster.dsn, application_name="outbox-bench")
            admin.execute("CREATE DATABASE soak")
            admin.close()
            dsn = cluster.dsn.rsplit("/", 1)[0] + "/soak"
            conn = session.connect(dsn, application_name="outbox-bench")
            migrate.migrate(conn, "outbox")
            conn.close()
            yield cluster, dsn, rabbit
    finally:
        rabbit.destroy()


def declare(rabbit: RabbitNode, exchange: str, queue: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(rabbit.url))
    channel = conn.channel()
    channel.exchange_declare(exchange, "topic", durable=True)
    channel.queue_declare(queue, durable=True)
    channel.queue_bind(queue, exchange, "#")
    conn.close()


class Faults(threading.Thread):
    """Runs the fault schedule; notes when each fault began and how long it took."""

    def __init__(
        self,
        o: SoakOptions,
        start: float,
        relay: Relay,
        cluster: PostgresCluster,
        dsn: str,
        rabbit: RabbitNode,
        echo: Any,
    ) -> None:
        super().__init__(daemon=True)
        self.o, self.start_at, self.relay = o, start, relay
        self.cluster, self.dsn, self.rabbit, self.echo = cluster, dsn, rabbit, echo
        self.done: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self._snapshot: session.Conn | None = None
        self._release_at = 0.0

    def run(self) -> None:
        try:
            for at, kind in fault_schedule(self.o.seconds, self.o.fault_interval):
                self._wait_until(self.start_at + at)
                began = time.perf_counter()
                self._inject(kind)
                took = time.perf_counter() - began
                # A slow restart delays the faults after it: note when each began.
                at = began - self.start_at
                self.done.append({"at_s": round(at, 1), "fault": kind, "took_s": round(took, 1)})
                self.echo(f"  {at:.0f} s: {kind} ({took:.1f} s)")
            self._wait_until(self.start_at + self.o.seconds)
        except BaseException as exc:
            self.error = exc
        finally:
            self._release()

    def _wait_until(self, when: float) -> None:
        while True:
            now = time.perf_counter()
            if self._snapshot is not None and now >= self._release_at:
                self._release()
            if now >= when:
                return
            time.sleep(min(0.1, when - now))

    def _inject(self, kind: str) -> None:
        if kind == "relay-kill":
            self.relay.kill()
        elif kind == "broker-restart":
            self.rabbit.restart()
        elif kind == "postgres-restart":
            self.cluster.restart("fast")
        elif kind == "snapshot":
            self._release()
            conn = session.connect(self.dsn, application_name="outbox-bench-snapshot")
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            conn.execute('SELECT count(*) FROM "outbox"')
            self._snapshot = conn
            self._release_at = time.perf_counter() + self.o.snapshot_seconds

    def _release(self) -> None:
        if self._snapshot is not None:
            with contextlib.suppress(Exception):
                self._snapshot.close()
            self._snapshot = None


def dead_rows(dsn: str) -> int | None:
    """The outbox's dead rows now; None while PostgreSQL restarts."""
    try:
        reader = HorizonReader(
            dsn, "outbox", application_name="outbox-bench-soak", statement_timeout=10
        )
    except OutboxError:
        return None
    try:
        return reader.horizon(limit=1).dead_rows
    except OutboxError:
        return None
    finally:
        reader.close()


def leftovers(dsn: str) -> tuple[int, int]:
    """(rows left in the outbox, prepared transactions left)."""
    conn = session.connect(dsn, application_name="outbox-bench-soak")
    try:
        rows = conn.execute('SELECT count(*) AS n FROM "outbox"').fetchone()
        prepared = conn.execute(
            "SELECT count(*) AS n FROM pg_prepared_xacts WHERE database = current_database()"
        ).fetchone()
        return int(rows["n"] if rows else 0), int(prepared["n"] if prepared else 0)
    finally:
        conn.close()


def run_soak(o: SoakOptions, echo: Any) -> dict[str, Any]:
    suffix = uuid.uuid4().hex[:8]
    exchange = queue = f"outbox.soak.{suffix}"
    with soak_servers(echo) as (cluster, dsn, rabbit):
        declare(rabbit, exchange, queue)
        settings = Settings(
            dsn=dsn,
            amqp_url=rabbit.url,
            table="outbox",
            ledger_queue=f"outbox.soak.ledger.{suffix}",
        )
        receiver = SoakReceiver(rabbit, queue)
        receiver.start()
        log_dir = tempfile.mkdtemp(prefix="outbox-soak-logs-")
        echo(f"the relays' logs: {log_dir}")
        relay = Relay(settings, log_dir)
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        start = time.perf_counter() + PRODUCER_START_SECONDS
        producer = context.Process(
            target=produce, args=(dsn, "outbox", exchange, o, start, results), daemon=True
        )
        producer.start()
        faults = Faults(o, start, relay, cluster, dsn, rabbit, echo)
        faults.start()
        samples: list[dict[str, Any]] = []
        try:
            windows = max(1, round(o.seconds / o.window))
            received = 0
            for i in range(1, windows + 1):
                at = start + min(o.seconds, i * o.window)
                while time.perf_counter() < at:
                    time.sleep(min(0.2, max(0.0, at - time.perf_counter())))
                relay.check_alive()
                rss, files = relay.process_figures()
                samples.append({"rss_bytes": rss, "open_files": files, "dead_rows": dead_rows(dsn)})
                echo(
                    f"  {i * o.window:.0f} s: {len(receiver.arrived):,} received, relay RSS "
                    f"{(rss or 0) / 2**20:.0f} MiB, {files} open files"
                )
                if len(receiver.arrived) == received:
                    # A window without a message: what the relay was doing meanwhile.
                    echo(f"  nothing received in this window; the relay's log:\n{relay.log_tail()}")
                received = len(receiver.arrived)
            outcome = results.get(timeout=PRODUCER_START_SECONDS + 120)
            if isinstance(outcome, str):
                raise OutboxError(f"the soak's producer failed: {outcome}")
            faults.join(timeout=120)
            if faults.error is not None:
                raise OutboxError(f"a soak fault failed: {faults.error}")
            committed: dict[str, float] = outcome["committed"]
            every_row = [*committed, *outcome["committed_unseen"]]
            deadline = time.monotonic() + DRAIN_SECONDS
            while time.monotonic() < deadline:
                if all(m in receiver.arrived for m in every_row) and leftovers(dsn) == (0, 0):
                    break
                time.sleep(0.5)
            rows_left, prepared_left = leftovers(dsn)
        except BaseException:
            echo(f"the soak failed; the running relay's log ({log_dir}):\n{relay.log_tail()}")
            raise
        finally:
            relay.stop()
            receiver.stop()
            producer.join(timeout=10)
            if producer.is_alive():
                producer.kill()
    arrived = receiver.arrived
    lost = sum(1 for m in every_row if m not in arrived)
    faults_that_duplicate = sum(1 for f in faults.done if f["fault"] != "snapshot")
    bound = faults_that_duplicate * 2 * settings.batch_size
    return {
        "seconds": o.seconds,
        "window_seconds": o.window,
        "fault_interval_seconds": o.fault_interval,
        "snapshot_seconds": o.snapshot_seconds,
        "rate": o.rate,
        "rows_per_commit": o.rows_per_commit,
        "payload_bytes": o.payload,
        "faults": faults.done,
        "windows": soak_windows(committed, arrived, start, o.window, samples),
        "committed": len(every_row),
        "committed_unseen": len(outcome["committed_unseen"]),
        "never_committed": outcome["failed"],
        "producer_reconnects": outcome["reconnects"],
        "arrived": len(arrived),
        "lost": lost,
        "rows_left": rows_left,
        "prepared_left": prepared_left,
        "duplicates": receiver.duplicates,
        "duplicate_bound": bound,
        "consumer_redeliveries": receiver.redelivered,
        "relays_killed": relay.killed,
        "relay_logs": log_dir,
        "nothing_lost": lost == 0 and rows_left == 0 and prepared_left == 0,
        "duplicates_within_bound": receiver.duplicates <= bound,
    }


def soak_windows(
    committed: dict[str, float],
    arrived: dict[str, float],
    start: float,
    window: float,
    samples: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Per window: latency by commit time, throughput by arrival time, the samples."""
    latencies: list[list[float]] = [[] for _ in samples]
    received = [0] * len(samples)
    for message_id, when in committed.items():
        index = int((when - start) // window)
        if 0 <= index < len(samples) and message_id in arrived:
            latencies[index].append((arrived[message_id] - when) * 1000)
    for when in arrived.values():
        index = int((when - start) // window)
        if 0 <= index < len(samples):
            received[index] += 1
    rows = []
    for i, sample in enumerate(samples):
        values = sorted(latencies[i])
        rows.append(
            {
                "window": i,
                "from_s": round(i * window, 1),
                "to_s": round((i + 1) * window, 1),
                "p50_ms": round(percentile(values, 50), 2) if values else None,
                "p99_ms": round(percentile(values, 99), 2) if values else None,
                "msg_per_s": round(received[i] / window, 1),
                **sample,
            }
        )
    return rows


def render(report: dict[str, Any]) -> str:
    faults = (
        ", ".join(f"{f['at_s']:.0f} s {f['fault']} ({f['took_s']:.0f} s)" for f in report["faults"])
        or "none"
    )
    lines = [
        f"outbox bench --soak: {report['seconds']:.0f} s at {report['rate']:,.0f} rows/s "
        f"({report['rows_per_commit']}-row transactions, {report['payload_bytes']} B), one "
        f"relay with default settings, private PostgreSQL (fsync on) and RabbitMQ; a fault "
        f"every {report['fault_interval_seconds']:.0f} s, the snapshot held "
        f"{report['snapshot_seconds']:.0f} s",
        f"faults: {faults}",
        "",
        "| window | p50 | p99 | msg/s | relay RSS | open files | dead rows |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for w in report["windows"]:
        p50 = "-" if w["p50_ms"] is None else f"{w['p50_ms']:.1f} ms"
        p99 = "-" if w["p99_ms"] is None else f"{w['p99_ms']:.1f} ms"
        rss = "-" if w["rss_bytes"] is None else f"{w['rss_bytes'] / 2**20:.0f} MiB"
        files = "-" if w["open_files"] is None else str(w["open_files"])
        dead = "-" if w["dead_rows"] is None else f"{w['dead_rows']:,}"
        lines.append(
            f"| {w['from_s']:.0f}-{w['to_s']:.0f} s | {p50} | {p99} | {w['msg_per_s']:,.0f} | "
            f"{rss} | {files} | {dead} |"
        )
    lines += [
        "",
        f"{report['committed']:,} rows committed ({report['committed_unseen']:,} of them in "
        f"transactions whose COMMIT lost its session, found committed with pg_xact_status; "
        f"{report['never_committed']:,} rows in transactions that failed), "
        f"{report['lost']} lost, {report['rows_left']} left in the outbox, "
        f"{report['prepared_left']} prepared transactions left; {report['duplicates']} "
        f"duplicates (bound {report['duplicate_bound']:,}: 2 batches per fault), "
        f"{report['relays_killed']} relays killed",
        "nothing lost" if report["nothing_lost"] else "ROWS LOST OR LEFT BEHIND",
        "duplicates within the bound"
        if report["duplicates_within_bound"]
        else "DUPLICATES ABOVE THE BOUND",
    ]
    return "\n".join(lines)
