"""``outbox bench --consume``: ``outbox consume`` next to a bare kombu consumer.

Both consume the same number of persistent messages of the same size from a queue
filled beforehand, with the same prefetch, in alternating runs:

1. **bare**: a kombu ``Consumer`` in this process that acks every message and does
   nothing else: the broker-side ceiling.
2. **inbox**: ``outbox consume`` as a subprocess, exactly as deployed, with a
   trivial handler that writes one effect row per message.  Each message is one
   transaction on the consumer's database (inbox insert + effect + COMMIT, then
   the ack), so this measures exactly-once effects, commit included.

Each rate is messages over the time from the first message to the last (for the
inbox: the first and last effect row's ``clock_timestamp()``), so process
start-up is not counted.  The report gives the medians and their ratio, and
checks that every message had exactly one effect.  Benchmarks print figures;
nothing here is a timed assertion.
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
import time
import uuid
from collections.abc import Callable
from typing import Any

from kombu.connection import Connection
from kombu.entity import Queue
from kombu.messaging import Consumer

from outbox.bench.harness import Broker, Database, bare_publish, bench_database
from outbox.db import session
from outbox.errors import OutboxError

Echo = Callable[[str], None]

HANDLER = """
def handle(conn, message):
    conn.execute("INSERT INTO bench_effects (message_id) VALUES (%s)", [message.message_id])
"""


@dataclasses.dataclass(frozen=True)
class ConsumeBenchOptions:
    amqp_url: str
    dsn: str | None = None
    rows: int = 20_000
    payload: int = 1024
    repeats: int = 3
    prefetch: int = 10
    window: int = 1000


class ConsumeBench:
    def __init__(
        self, options: ConsumeBenchOptions, db: Database, broker: Broker, echo: Echo
    ) -> None:
        self.o, self.db, self.broker, self.echo = options, db, broker, echo
        self.conn = session.connect(db.dsn, application_name="outbox-bench")
        self.conn.execute(
            "CREATE TABLE IF NOT EXISTS bench_effects (message_id text, "
            "at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
        self.bodies = [f"{i}:".encode().ljust(options.payload, b"x") for i in range(options.rows)]
        self.folder = tempfile.mkdtemp(prefix="outbox-bench-consume-")
        with open(os.path.join(self.folder, "bench_handler.py"), "w") as handler:
            handler.write(HANDLER)

    def fill(self) -> list[str]:
        ids = [str(uuid.uuid4()) for _ in self.bodies]
        self.broker.purge()
        bare_publish(
            self.o.amqp_url,
            self.broker.exchange,
            "bench.consume",
            self.bodies,
            ids,
            window=self.o.window,
        )
        if self.broker.depth() != len(ids):
            raise OutboxError(f"the bench queue holds {self.broker.depth()} of {len(ids)}")
        return ids

    def bare(self) -> dict[str, Any]:
        """A kombu consumer that acks each message: seconds from first to last."""
        ids = self.fill()
        arrived: list[float] = []

        def on_message(message: Any) -> None:
            arrived.append(time.perf_counter())
            message.ack()

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
        return {"messages": len(arrived), "seconds": seconds, "rate": _rate(len(arrived), seconds)}

    def inbox(self) -> dict[str, Any]:
        """``outbox consume`` with the trivial handler: effects/s, first to last effect."""
        ids = self.fill()
        self.conn.execute("TRUNCATE bench_effects")
        env = dict(
            os.environ,
            OUTBOX_DSN=self.db.dsn,
            OUTBOX_AMQP_URL=self.o.amqp_url,
            OUTBOX_QUEUE=self.broker.queue,
            OUTBOX_INBOX_TABLE="bench_inbox",
            OUTBOX_PREFETCH=str(self.o.prefetch),
            OUTBOX_LOG_LEVEL="warning",
        )
        env.pop("OUTBOX_METRICS_PORT", None)
        with tempfile.TemporaryFile() as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "outbox", "consume", "bench_handler:handle"],
                cwd=self.folder,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
            try:
                self._wait_for_effects(len(ids), process, log)
            finally:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        row = self.conn.execute(
            "SELECT count(*) AS effects, count(DISTINCT message_id) AS distinct_ids, "
            "extract(epoch FROM max(at) - min(at))::float8 AS seconds FROM bench_effects"
        ).fetchone()
        assert row is not None
        self.conn.execute("TRUNCATE bench_inbox")
        seconds = float(row["seconds"] or 0.0)
        return {
            "messages": int(row["effects"]),
            "exactly_once": row["effects"] == row["distinct_ids"] == len(ids),
            "seconds": seconds,
            "rate": _rate(int(row["effects"]), seconds),
        }

    def _wait_for_effects(self, count: int, process: subprocess.Popen[bytes], log: Any) -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if process.poll() is not None:
                log.seek(0)
                text = log.read().decode(errors="replace")[-2000:]
                raise OutboxError(f"outbox consume exited with {process.returncode}:\n{text}")
            row = self.conn.execute("SELECT count(*) AS n FROM bench_effects").fetchone()
            if row and row["n"] >= count:
                return
            time.sleep(0.05)
        raise OutboxError("outbox consume did not finish within 600 s")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            for table in ("bench_effects", "bench_inbox", "bench_inbox_attempts"):
                self.conn.execute(f"DROP TABLE IF EXISTS {table}")
            self.conn.execute("DROP TABLE IF EXISTS bench_inbox_parked")
        with contextlib.suppress(Exception):
            self.conn.close()
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.folder, "bench_handler.py"))
            os.rmdir(self.folder)


def _rate(messages: int, seconds: float) -> float:
    return messages / seconds if seconds > 0 else 0.0


def run_consume_bench(options: ConsumeBenchOptions, echo: Echo) -> dict[str, Any]:
    suffix = uuid.uuid4().hex[:8]
    with bench_database(options.dsn, echo) as db:
        broker = Broker(options.amqp_url, suffix)
        bench = ConsumeBench(options, db, broker, echo)
        try:
            bare_runs, inbox_runs = [], []
            for i in range(options.repeats):
                bare_runs.append(bench.bare())
                echo(f"  bare kombu consumer run {i + 1}: {bare_runs[-1]['rate']:,.0f} msg/s")
                inbox_runs.append(bench.inbox())
                echo(f"  outbox consume      run {i + 1}: {inbox_runs[-1]['rate']:,.0f} effects/s")
            server = bench.conn.execute("SHOW server_version").fetchone()
        finally:
            bench.close()
            broker.delete()
    bare_rate = statistics.median(r["rate"] for r in bare_runs)
    inbox_rate = statistics.median(r["rate"] for r in inbox_runs)
    return {
        "machine": {"cpus": os.cpu_count(), "postgres": db.description},
        "server_version": server["server_version"] if server else None,
        "rows": options.rows,
        "payload_bytes": options.payload,
        "repeats": options.repeats,
        "prefetch": options.prefetch,
        "consume": {
            "bare_msg_per_s": [round(r["rate"]) for r in bare_runs],
            "inbox_effects_per_s": [round(r["rate"]) for r in inbox_runs],
            "bare_median": round(bare_rate),
            "inbox_median": round(inbox_rate),
            "ratio": round(inbox_rate / bare_rate, 3) if bare_rate else None,
        },
        "every_message_once": all(r["messages"] == options.rows for r in bare_runs)
        and all(r["exactly_once"] for r in inbox_runs),
    }


def render(report: dict[str, Any]) -> str:
    c = report["consume"]
    ratio = f"{c['ratio']:.2f}" if c["ratio"] is not None else "-"
    return "\n".join(
        [
            f"outbox bench --consume: {report['rows']} messages of {report['payload_bytes']} B, "
            f"prefetch {report['prefetch']}, {report['machine']['cpus']} CPUs, PostgreSQL "
            f"{report['server_version']} ({report['machine']['postgres']}), "
            f"medians of {report['repeats']}",
            "",
            "| what | per second | ratio to bare |",
            "|---|---:|---:|",
            f"| bare kombu consumer (ack only) | {c['bare_median']:,} msg | 1.00 |",
            f"| outbox consume, one-row handler | {c['inbox_median']:,} effects | {ratio} |",
            "",
            "runs: bare "
            + " / ".join(f"{r:,}" for r in c["bare_msg_per_s"])
            + "; inbox "
            + " / ".join(f"{r:,}" for r in c["inbox_effects_per_s"]),
            "every message had exactly one effect"
            if report["every_message_once"]
            else "MESSAGES MISSING OR DOUBLED",
        ]
    )
