"""``outbox bench --consume``: ``outbox consume`` next to a bare kombu consumer.

All consume the same number of persistent messages of the same size from a queue
filled beforehand, with the same prefetch, in alternating runs:

1. **bare**: a kombu ``Consumer`` in this process that acks every message and does
   nothing else: the broker-side ceiling.
2. **hand-written**: what a user would write without ``outbox consume``: kombu +
   psycopg in this process, one transaction per message (the id into an inbox
   table, ``ON CONFLICT DO NOTHING``; if new, the effect row), COMMIT, then the ack.
   Exactly-once effects too, the simple way.
3. **inbox**: ``outbox consume`` as a subprocess, exactly as deployed, with a
   trivial handler that writes one effect row per message (inbox insert + effect +
   COMMIT, then the ack), so this measures exactly-once effects, commit included.
4. **async inbox**: the same with the same handler written ``async def`` (its
   INSERT awaited on the ``AsyncConnection`` it is handed: ``outbox.inbox.aio``).

Each rate is messages over the time from the first message to the last (for the
hand-written consumer and the inbox: the first and last effect row's
``clock_timestamp()``), so process start-up is not counted.  The report gives the
medians and the ratios, and checks that every message had exactly one effect.

Then **latency**: ``outbox consume`` left running, the bench publishes messages at a
fixed rate and notes when each one's effect is *committed*: a trigger on the
effect table sends a NOTIFY, which PostgreSQL delivers only when the transaction
commits, to a listener in this process (same clock as the publisher).
Benchmarks print figures; nothing here is a timed assertion.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
from kombu.connection import Connection
from kombu.entity import Queue
from kombu.messaging import Consumer, Producer

from outbox.amqp.message import InboxMessage
from outbox.bench.harness import (
    BenchTopology,
    Database,
    Echo,
    bare_publish,
    bench_database,
    is_postgres,
    per_10k,
    percentile,
    process_cpu_seconds,
)
from outbox.db import session
from outbox.errors import OutboxError


def handle(conn: Any, message: InboxMessage) -> None:
    """The bench's handler: one effect row per message."""
    conn.execute("INSERT INTO bench_effects (message_id) VALUES (%s)", [message.message_id])


async def handle_async(conn: Any, message: InboxMessage) -> None:
    """The same, ``async def``."""
    await conn.execute("INSERT INTO bench_effects (message_id) VALUES (%s)", [message.message_id])


# The handler module ``outbox consume`` is given (a file of the bench's own, in its
# working directory, as a user's would be); ``outbox bench --consume-returned`` runs
# the same handler in its own process.
HANDLER = "from outbox.bench.consume import handle, handle_async\n"

# ``outbox consume`` with each of them: a plain handler, an ``async def`` one.
SYNC_HANDLER = "bench_handler:handle"
ASYNC_HANDLER = "bench_handler:handle_async"


@dataclasses.dataclass(frozen=True)
class ConsumeBenchOptions:
    amqp_url: str
    dsn: str | None = None
    rows: int = 20_000
    payload: int = 1024
    repeats: int = 3
    prefetch: int = 10
    window: int = 1000
    latency_rate: float = 200.0  # messages/s published while ``outbox consume`` runs
    latency_seconds: float = 5.0


class ConsumeBench:
    def __init__(
        self, options: ConsumeBenchOptions, db: Database, broker: BenchTopology, echo: Echo
    ) -> None:
        self.o, self.db, self.broker, self.echo = options, db, broker, echo
        self.conn = session.connect(db.dsn, application_name="outbox-bench")
        self.conn.execute(
            "CREATE TABLE IF NOT EXISTS bench_effects (message_id text, "
            "at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
        self.conn.execute(
            "CREATE TABLE IF NOT EXISTS bench_handwritten_inbox (message_id text PRIMARY KEY)"
        )
        self.bodies = [f"{i}:".encode().ljust(options.payload, b"x") for i in range(options.rows)]
        self._logs: dict[int, Any] = {}  # of the running ``outbox consume`` processes
        self.folder = tempfile.mkdtemp(prefix="outbox-bench-consume-")
        with open(os.path.join(self.folder, "bench_handler.py"), "w") as handler:
            handler.write(HANDLER)

    def fill(self, broker: BenchTopology | None = None, count: int | None = None) -> list[str]:
        """``count`` (all: ``--rows``) new messages on ``broker``'s queue (the
        bench's own by default), emptied first; their ids."""
        broker = broker or self.broker
        bodies = self.bodies[:count] if count is not None else self.bodies
        ids = [str(uuid.uuid4()) for _ in bodies]
        broker.purge()
        bare_publish(
            self.o.amqp_url,
            broker.exchange,
            "bench.consume",
            bodies,
            ids,
            window=self.o.window,
        )
        if broker.depth() != len(ids):
            raise OutboxError(f"the bench queue holds {broker.depth()} of {len(ids)}")
        return ids

    def bare(self) -> dict[str, Any]:
        """A kombu consumer that acks each message: seconds from first to last."""
        ids = self.fill()
        arrived: list[float] = []
        cpu: list[float] = []  # this process's CPU at the first and the last message

        def on_message(message: Any) -> None:
            arrived.append(time.perf_counter())
            message.ack()
            if len(arrived) == 1 or len(arrived) == len(ids):
                cpu.append(time.process_time())

        with Connection(self.o.amqp_url) as conn:
            consumer = Consumer(
                conn.channel(),
                queues=[Queue(self.broker.queue, no_declare=True)],
                on_message=on_message,
                prefetch_count=self.o.prefetch,
                auto_declare=False,
            )
            consumer.consume()
            deadline = time.monotonic() + 300
            while len(arrived) < len(ids) and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=1)
            consumer.cancel()
        seconds = arrived[-1] - arrived[0] if len(arrived) > 1 else 0.0
        return {
            "messages": len(arrived),
            "seconds": seconds,
            "rate": _rate(len(arrived), seconds),
            # The bare consumer runs alone in this process: its CPU is the process's.
            "cpu_s_per_10k": per_10k(cpu[-1] - cpu[0], len(arrived) - 1) if len(cpu) > 1 else None,
            "backend_cpu_s_per_10k": None,
        }

    def handwritten(self) -> dict[str, Any]:
        """kombu + psycopg, one transaction per message: effects/s, first to last effect."""
        ids = self.fill()
        self.conn.execute("TRUNCATE bench_effects, bench_handwritten_inbox")
        db = psycopg.connect(self.db.dsn, application_name="outbox-bench-handwritten")
        backend = db.info.backend_pid if is_postgres(db.info.backend_pid) else None
        handled = [0]
        cpu: list[tuple[float, float | None]] = []  # at the first and the last message

        def on_message(message: Any) -> None:
            message_id = message.properties.get("message_id")
            with db.transaction():
                new = db.execute(
                    "INSERT INTO bench_handwritten_inbox (message_id) VALUES (%s) "
                    "ON CONFLICT DO NOTHING",
                    [message_id],
                ).rowcount
                if new:
                    db.execute("INSERT INTO bench_effects (message_id) VALUES (%s)", [message_id])
            message.ack()
            handled[0] += 1
            if handled[0] == 1 or handled[0] == len(ids):
                cpu.append((time.process_time(), process_cpu_seconds(backend) if backend else None))

        try:
            with Connection(self.o.amqp_url) as conn:
                consumer = Consumer(
                    conn.channel(),
                    queues=[Queue(self.broker.queue, no_declare=True)],
                    on_message=on_message,
                    prefetch_count=self.o.prefetch,
                    auto_declare=False,
                )
                consumer.consume()
                deadline = time.monotonic() + 600
                while handled[0] < len(ids) and time.monotonic() < deadline:
                    with contextlib.suppress(TimeoutError):
                        conn.drain_events(timeout=1)
                consumer.cancel()
        finally:
            db.close()
        result = self.effects(len(ids))
        result.update(_cpu_window(cpu, handled[0] - 1))
        return result

    def inbox(self, handler: str = SYNC_HANDLER) -> dict[str, Any]:
        """``outbox consume`` with the trivial handler: effects/s, first to last effect."""
        return self.applied(self.fill(), handler)

    def applied(
        self, ids: list[str], handler: str = SYNC_HANDLER, queue: str | None = None
    ) -> dict[str, Any]:
        """``outbox consume`` (a subprocess) applying the messages ``ids`` waiting on
        ``queue`` (the bench's own by default): effects/s from the first effect to the
        last, CPU per 10,000 messages; the inbox emptied after."""
        self.conn.execute("TRUNCATE bench_effects")
        with self.consume_process(handler, queue) as process:
            cpu = self.wait_for_effects(len(ids), process)
        result = self.effects(len(ids))
        result.update(cpu)
        self.conn.execute("TRUNCATE bench_inbox")
        return result

    def latency(self) -> dict[str, Any]:
        """Publish → committed effect, with ``outbox consume`` running and idle between
        messages: the NOTIFY of a trigger on the effect table arrives at COMMIT."""
        self.broker.purge()
        self.conn.execute("TRUNCATE bench_effects")
        self.conn.execute(
            "CREATE OR REPLACE FUNCTION bench_effect_committed() RETURNS trigger "
            "LANGUAGE plpgsql AS $$ BEGIN "
            "PERFORM pg_notify('bench_effects', NEW.message_id); RETURN NULL; END $$"
        )
        self.conn.execute(
            "CREATE OR REPLACE TRIGGER bench_effect_committed AFTER INSERT ON bench_effects "
            "FOR EACH ROW EXECUTE FUNCTION bench_effect_committed()"
        )
        listener = _CommitListener(self.db.dsn)
        count = max(1, int(self.o.latency_rate * self.o.latency_seconds))
        published: dict[str, float] = {}
        try:
            with self.consume_process() as process, Connection(self.o.amqp_url) as connection:
                producer = Producer(connection.channel())
                # One message first: the consumer is subscribed once its effect commits.
                warm_up = str(uuid.uuid4())
                _publish(producer, self.broker.exchange, warm_up, b"warm-up")
                listener.wait_for({warm_up}, process, timeout=60)
                body = b"x" * self.o.payload
                started = time.perf_counter()
                for i in range(count):
                    pause = started + i / self.o.latency_rate - time.perf_counter()
                    if pause > 0:
                        time.sleep(pause)
                    message_id = str(uuid.uuid4())
                    published[message_id] = time.perf_counter()
                    _publish(producer, self.broker.exchange, message_id, body)
                published_rate = count / (time.perf_counter() - started)
                listener.wait_for(set(published), process, timeout=30)
        finally:
            listener.stop()
            self.conn.execute("DROP TRIGGER IF EXISTS bench_effect_committed ON bench_effects")
            self.conn.execute("TRUNCATE bench_inbox")
        latencies = sorted(
            (listener.committed[m] - t) * 1000
            for m, t in published.items()
            if m in listener.committed
        )
        result: dict[str, Any] = {
            "rate_per_s": self.o.latency_rate,
            "published_per_s": round(published_rate),
            "sent": count,
            "committed": len(latencies),
        }
        for q in (50, 95, 99):
            result[f"p{q}_ms"] = round(percentile(latencies, q), 2)
        result["max_ms"] = round(latencies[-1], 2) if latencies else None
        return result

    @contextlib.contextmanager
    def consume_process(
        self, handler: str = SYNC_HANDLER, queue: str | None = None
    ) -> Iterator[subprocess.Popen[bytes]]:
        """``outbox consume`` with the bench handler on ``queue`` (the bench's own by
        default), stopped with SIGTERM."""
        env = dict(
            os.environ,
            OUTBOX_DSN=self.db.dsn,
            OUTBOX_AMQP_URL=self.o.amqp_url,
            OUTBOX_QUEUE=queue or self.broker.queue,
            OUTBOX_INBOX_TABLE="bench_inbox",
            OUTBOX_PREFETCH=str(self.o.prefetch),
            OUTBOX_LOG_LEVEL="warning",
        )
        env.pop("OUTBOX_METRICS_PORT", None)
        with tempfile.TemporaryFile() as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "outbox", "consume", handler],
                cwd=self.folder,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
            self._logs[process.pid] = log
            try:
                yield process
            finally:
                del self._logs[process.pid]
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

    def effects(self, expected: int) -> dict[str, Any]:
        row = self.conn.execute(
            "SELECT count(*) AS effects, count(DISTINCT message_id) AS distinct_ids, "
            "extract(epoch FROM max(at) - min(at))::float8 AS seconds FROM bench_effects"
        ).fetchone()
        assert row is not None
        seconds = float(row["seconds"] or 0.0)
        return {
            "messages": int(row["effects"]),
            "exactly_once": row["effects"] == row["distinct_ids"] == expected,
            "seconds": seconds,
            "rate": _rate(int(row["effects"]), seconds),
        }

    def wait_for_effects(
        self, count: int, process: subprocess.Popen[bytes]
    ) -> dict[str, float | None]:
        """Wait until ``count`` effects are in; the CPU per 10,000 effects of the
        ``outbox consume`` process and of its PostgreSQL backend, from the first
        poll that saw effects to the one that saw them all (start-up not counted)."""
        deadline = time.monotonic() + 600
        backend: int | None = None
        first: tuple[int, float, float | None] | None = None
        while time.monotonic() < deadline:
            check_running(process, self._logs.get(process.pid))
            n = self.effect_count()
            if n and backend is None:
                backend = self._consumer_backend()
            if n:
                own = process_cpu_seconds(process.pid) or 0.0
                theirs = process_cpu_seconds(backend) if backend else None
                if first is None:
                    first = (n, own, theirs)
                if n >= count:
                    return _cpu_window([first[1:], (own, theirs)], n - first[0])
            time.sleep(0.05)
        raise OutboxError("outbox consume did not finish within 600 s")

    def effect_count(self) -> int:
        row = self.conn.execute("SELECT count(*) AS n FROM bench_effects").fetchone()
        return int(row["n"]) if row else 0

    def about(self) -> dict[str, Any]:
        """What every consumer bench's report says first: the machine, the server and
        the options measured."""
        server = self.conn.execute("SHOW server_version").fetchone()
        return {
            "machine": {"cpus": os.cpu_count(), "postgres": self.db.description},
            "server_version": server["server_version"] if server else None,
            "rows": self.o.rows,
            "payload_bytes": self.o.payload,
            "repeats": self.o.repeats,
            "prefetch": self.o.prefetch,
        }

    def _consumer_backend(self) -> int | None:
        """The pid of ``outbox consume``'s PostgreSQL backend (None: not local)."""
        row = self.conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = 'outbox-consume'"
        ).fetchone()
        pid = int(row["pid"]) if row else None
        return pid if pid is not None and is_postgres(pid) else None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.execute("DROP FUNCTION IF EXISTS bench_effect_committed() CASCADE")
            for table in (
                "bench_effects",
                "bench_inbox",
                "bench_inbox_attempts",
                "bench_inbox_custody",
                "bench_handwritten_inbox",
            ):
                self.conn.execute(f"DROP TABLE IF EXISTS {table}")
            self.conn.execute("DROP TABLE IF EXISTS bench_inbox_parked")
            self.conn.execute("DROP FUNCTION IF EXISTS bench_inbox_guard()")
        with contextlib.suppress(Exception):
            self.conn.close()
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.folder, "bench_handler.py"))
            os.rmdir(self.folder)


def _publish(producer: Producer, exchange: str, message_id: str, body: bytes) -> None:
    producer.publish(
        body,
        exchange=exchange,
        routing_key="bench.consume",
        message_id=message_id,
        delivery_mode=2,
        content_type="application/octet-stream",
        content_encoding="binary",
    )


def check_running(process: subprocess.Popen[bytes], log: Any) -> None:
    """Raise with the end of its log if ``outbox consume`` has exited."""
    if process.poll() is None:
        return
    text = ""
    if log is not None:
        log.seek(0)
        text = log.read().decode(errors="replace")[-2000:]
    raise OutboxError(f"outbox consume exited with {process.returncode}:\n{text}")


class _CommitListener(threading.Thread):
    """LISTENs for the effect trigger's NOTIFY: when each message's effect committed."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.committed: dict[str, float] = {}
        self._conn = session.connect(dsn, application_name="outbox-bench-listener")
        self._conn.execute("LISTEN bench_effects")
        self._halt = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._halt.is_set():
            for notify in self._conn.notifies(timeout=0.05):
                self.committed.setdefault(notify.payload, time.perf_counter())

    def wait_for(
        self, message_ids: set[str], process: subprocess.Popen[bytes], timeout: float
    ) -> None:
        deadline = time.monotonic() + timeout
        while not message_ids <= self.committed.keys() and time.monotonic() < deadline:
            check_running(process, None)
            time.sleep(0.02)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
        with contextlib.suppress(Exception):
            self._conn.close()


def _cpu_window(
    samples: list[tuple[float, float | None]], messages: int
) -> dict[str, float | None]:
    """CPU per 10,000 messages between the first and the last of ``samples``
    ((own CPU, backend CPU or None) each) over ``messages``."""
    if len(samples) < 2 or messages <= 0:
        return {"cpu_s_per_10k": None, "backend_cpu_s_per_10k": None}
    (own0, theirs0), (own1, theirs1) = samples[0], samples[-1]
    backend = theirs1 - theirs0 if theirs0 is not None and theirs1 is not None else None
    return {
        "cpu_s_per_10k": per_10k(own1 - own0, messages),
        "backend_cpu_s_per_10k": per_10k(backend, messages),
    }


def _rate(messages: int, seconds: float) -> float:
    return messages / seconds if seconds > 0 else 0.0


@contextlib.contextmanager
def consume_bench(
    options: ConsumeBenchOptions, echo: Echo, *, arguments: dict[str, Any] | None = None
) -> Iterator[ConsumeBench]:
    """A ``ConsumeBench`` on its database (``bench_database``) and a queue of its own
    (``arguments``: the queue's), both gone after."""
    with bench_database(options.dsn, echo) as db:
        broker = BenchTopology(options.amqp_url, uuid.uuid4().hex[:8], arguments=arguments)
        bench = ConsumeBench(options, db, broker, echo)
        try:
            yield bench
        finally:
            bench.close()
            broker.delete()


def run_consume_bench(options: ConsumeBenchOptions, echo: Echo) -> dict[str, Any]:
    with consume_bench(options, echo) as bench:
        bare_runs, handwritten_runs, inbox_runs, async_runs = [], [], [], []
        for i in range(options.repeats):
            bare_runs.append(bench.bare())
            echo(f"  bare kombu consumer run {i + 1}: {bare_runs[-1]['rate']:,.0f} msg/s")
            handwritten_runs.append(bench.handwritten())
            echo(
                f"  hand-written        run {i + 1}: {handwritten_runs[-1]['rate']:,.0f} effects/s"
            )
            inbox_runs.append(bench.inbox())
            echo(f"  outbox consume      run {i + 1}: {inbox_runs[-1]['rate']:,.0f} effects/s")
            async_runs.append(bench.inbox(ASYNC_HANDLER))
            echo(f"  ... async def       run {i + 1}: {async_runs[-1]['rate']:,.0f} effects/s")
        echo(f"  latency at {options.latency_rate:g} msg/s ...")
        latency = bench.latency()
        about = bench.about()
    bare_rate = statistics.median(r["rate"] for r in bare_runs)
    handwritten_rate = statistics.median(r["rate"] for r in handwritten_runs)
    inbox_rate = statistics.median(r["rate"] for r in inbox_runs)
    async_rate = statistics.median(r["rate"] for r in async_runs)
    return {
        **about,
        "consume": {
            "bare_msg_per_s": [round(r["rate"]) for r in bare_runs],
            "inbox_effects_per_s": [round(r["rate"]) for r in inbox_runs],
            "handwritten_effects_per_s": [round(r["rate"]) for r in handwritten_runs],
            "async_effects_per_s": [round(r["rate"]) for r in async_runs],
            "bare_median": round(bare_rate),
            "handwritten_median": round(handwritten_rate),
            "inbox_median": round(inbox_rate),
            "async_median": round(async_rate),
            "ratio": round(inbox_rate / bare_rate, 3) if bare_rate else None,
            "handwritten_ratio": round(handwritten_rate / bare_rate, 3) if bare_rate else None,
            "ratio_to_handwritten": (
                round(inbox_rate / handwritten_rate, 3) if handwritten_rate else None
            ),
            "async_ratio": round(async_rate / bare_rate, 3) if bare_rate else None,
            "async_ratio_to_handwritten": (
                round(async_rate / handwritten_rate, 3) if handwritten_rate else None
            ),
            # CPU seconds per 10,000 messages (/proc, medians): the consumer's process
            # and its PostgreSQL backend (None: not measured, or not on this machine).
            **cpu_medians("bare", bare_runs),
            **cpu_medians("handwritten", handwritten_runs),
            **cpu_medians("inbox", inbox_runs),
            **cpu_medians("async", async_runs),
        },
        "latency": latency,
        "every_message_once": all(r["messages"] == options.rows for r in bare_runs)
        and all(r["exactly_once"] for r in handwritten_runs + inbox_runs + async_runs)
        and latency["committed"] == latency["sent"],
    }


def cpu_medians(kind: str, runs: list[dict[str, Any]]) -> dict[str, float | None]:
    def median(key: str) -> float | None:
        values = [r.get(key) for r in runs]
        known = [v for v in values if v is not None]
        return round(statistics.median(known), 3) if known and len(known) == len(values) else None

    return {
        f"{kind}_cpu_s_per_10k": median("cpu_s_per_10k"),
        f"{kind}_backend_cpu_s_per_10k": median("backend_cpu_s_per_10k"),
    }


def cpu_cell(c: dict[str, Any], kind: str, backend: str = " PostgreSQL") -> str:
    """CPU s per 10k of ``cpu_medians(kind, …)``: the sum, then the consumer's and
    its PostgreSQL backend's (named ``backend``) apart."""
    own, theirs = c.get(f"{kind}_cpu_s_per_10k"), c.get(f"{kind}_backend_cpu_s_per_10k")
    if own is None:
        return "-"
    if theirs is None:
        return f"{own:.2f}"
    return f"{own + theirs:.2f} ({own:.2f} + {theirs:.2f}{backend})"


def _ratio(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def render(report: dict[str, Any]) -> str:
    c, lat = report["consume"], report["latency"]
    ratio = _ratio(c["ratio"])
    return "\n".join(
        [
            f"outbox bench --consume: {report['rows']} messages of {report['payload_bytes']} B, "
            f"prefetch {report['prefetch']}, {report['machine']['cpus']} CPUs, PostgreSQL "
            f"{report['server_version']} ({report['machine']['postgres']}), "
            f"medians of {report['repeats']}",
            "",
            "| what | per second | ratio to bare | ratio to hand-written | CPU s per 10k |",
            "|---|---:|---:|---:|---:|",
            f"| bare kombu consumer (ack only) | {c['bare_median']:,} msg | 1.00 | | "
            f"{cpu_cell(c, 'bare')} |",
            f"| hand-written kombu + psycopg, commit per message | "
            f"{c['handwritten_median']:,} effects | {_ratio(c['handwritten_ratio'])} | 1.00 | "
            f"{cpu_cell(c, 'handwritten')} |",
            f"| outbox consume, one-row handler | {c['inbox_median']:,} effects | {ratio} | "
            f"{_ratio(c['ratio_to_handwritten'])} | {cpu_cell(c, 'inbox')} |",
            f"| outbox consume, the same handler `async def` | {c['async_median']:,} effects | "
            f"{_ratio(c['async_ratio'])} | {_ratio(c['async_ratio_to_handwritten'])} | "
            f"{cpu_cell(c, 'async')} |",
            "",
            "CPU: the consumer's process, plus its PostgreSQL backend's where shown "
            "(the bare consumer has none).",
            "runs: bare "
            + " / ".join(f"{r:,}" for r in c["bare_msg_per_s"])
            + "; hand-written "
            + " / ".join(f"{r:,}" for r in c["handwritten_effects_per_s"])
            + "; inbox "
            + " / ".join(f"{r:,}" for r in c["inbox_effects_per_s"])
            + "; async "
            + " / ".join(f"{r:,}" for r in c["async_effects_per_s"]),
            f"latency publish → committed effect at {lat['rate_per_s']:g} msg/s "
            f"({lat['published_per_s']:,} reached), {lat['committed']}/{lat['sent']} committed: "
            f"p50 {lat['p50_ms']} ms, p95 {lat['p95_ms']} ms, p99 {lat['p99_ms']} ms, "
            f"max {lat['max_ms']} ms",
            "every message had exactly one effect"
            if report["every_message_once"]
            else "MESSAGES MISSING OR DOUBLED",
        ]
    )
