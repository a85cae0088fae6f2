"""``outbox bench --consume-returned``: what custody costs per message.

On a queue that may drop a returned message (a quorum queue with
``x-delivery-limit``) ``outbox consume`` takes every message the broker returned
into custody (``outbox.inbox.custody``): stored in ``<inbox>_custody`` and acked,
one transaction per drain of the socket, then applied from the table alone, its
attempt counted first (``steps.Processor.alone``).  Three cases, with the one-row
handler of ``--consume``, alternating (each repeat starts one case later), each
with new messages:

1. **custody**: ``--rows`` messages on a quorum queue with ``x-delivery-limit``
   (``DELIVERY_LIMIT``), every one returned once by the broker first: a consumer
   receives them all without acking and closes its connection, and they come back
   ``redelivered``, with ``x-delivery-count`` 1;
2. **redelivered**: the same on a quorum queue without a limit: no custody, each
   applied alone, as every redelivered message is;
3. **first deliveries**: messages never returned, on the queue of case 1: the
   batch path (custody looks at each drain and takes nothing).

Rates and CPU are taken as ``--consume`` takes them (``outbox consume`` as a
subprocess, first to last effect row; the consumer's process and its PostgreSQL
backend from ``/proc``).  Then, untimed, each case once more (``traced_rows``
messages) with the consumer in this process (``Inbox``, the same code) and libpq's
trace on its session (``TracedStore``): statements, round trips and COMMITs per
message as the consumer sent them (``traffic``), and the consumer's own count of
messages taken into custody, which shows each case took the path it names.
Benchmarks print figures; nothing here is a timed assertion.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any

import pika
from psycopg import pq

from outbox.bench.consume import (
    ConsumeBench,
    ConsumeBenchOptions,
    consume_bench,
    cpu_cell,
    cpu_medians,
    handle,
)
from outbox.bench.harness import BenchTopology, Echo
from outbox.db.inbox import InboxStore
from outbox.errors import OutboxError
from outbox.inbox.process import Inbox
from outbox.inbox.settings import MAX_PREFETCH, ConsumerSettings

# RabbitMQ 4.0's default for quorum queues; any limit above 1 takes the same path.
DELIVERY_LIMIT = 20
# Messages of each untimed, traced run.
TRACED_ROWS = 2000


@dataclasses.dataclass(frozen=True)
class Case:
    name: str  # its key in the report
    label: str
    limited: bool  # on the quorum queue with x-delivery-limit
    returned: bool  # every message returned once by the broker first


CASES = (
    Case("custody", "returned once; quorum, x-delivery-limit: custody", True, True),
    Case("redelivered", "returned once; quorum, no limit: alone, no custody", False, True),
    Case("first", "first deliveries; quorum, x-delivery-limit: batch", True, False),
)


@dataclasses.dataclass(frozen=True)
class Traffic:
    """What the consumer's session sent and got, per libpq's trace."""

    statements: int  # completed (CommandComplete)
    round_trips: int  # turns from the client sending to the server answering
    commits: int  # COMMITs completed


def traffic(lines: Iterable[str]) -> Traffic:
    """Count a libpq trace (``PQtrace`` lines, ``F``/``B`` first; pure).  A round
    trip is each turn from frontend messages to a backend one: a pipeline of
    statements is one, a statement waited for on its own is one."""
    statements = round_trips = commits = 0
    sending = False
    for line in lines:
        direction, _, rest = line.partition("\t")
        if direction == "F":
            sending = True
        elif direction == "B":
            if sending:
                round_trips += 1
                sending = False
            fields = rest.rstrip("\n").split("\t")
            if len(fields) >= 3 and fields[1] == "CommandComplete":
                statements += 1
                commits += fields[2].strip() == '"COMMIT"'
    return Traffic(statements, round_trips, commits)


class TracedStore(InboxStore):
    """The consumer's store, with libpq's trace of its session on from ``trace``
    until ``close`` (libpq writes the trace through a buffer that only
    ``untrace`` flushes, so it must come before the session ends)."""

    def trace(self, fileno: int) -> None:
        self.conn.pgconn.trace(fileno)
        self.conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)

    def close(self) -> None:
        if not self.conn.closed:
            with contextlib.suppress(Exception):
                self.conn.pgconn.untrace()
        super().close()


def return_all(amqp_url: str, topology: BenchTopology, count: int) -> None:
    """Have the broker return the ``count`` messages of ``topology``'s queue once:
    receive them all unacked, then close the connection (each is counted, and
    comes back ``redelivered``).  Returns once all are ready again."""
    deadline = time.monotonic() + 300
    received = [0]

    def on_message(_channel: Any, _method: Any, _props: Any, _body: bytes) -> None:
        received[0] += 1

    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        # A quorum queue gives a consumer without a prefetch limit 2,000 messages at
        # most, and basic.qos takes at most 65,535: one channel per 65,535.
        for first in range(0, count, MAX_PREFETCH):
            channel = conn.channel()
            channel.basic_qos(prefetch_count=min(MAX_PREFETCH, count - first))
            channel.basic_consume(topology.queue, on_message, auto_ack=False)
        while received[0] < count:
            if time.monotonic() > deadline:
                raise OutboxError(f"received {received[0]} of {count} messages to return")
            conn.process_data_events(time_limit=0.1)
    finally:
        conn.close()
    while topology.depth() < count:
        if time.monotonic() > deadline:
            raise OutboxError(f"{topology.depth()} of {count} messages came back")
        time.sleep(0.05)


class ReturnedBench:
    def __init__(self, consume: ConsumeBench, limited: BenchTopology, plain: BenchTopology) -> None:
        self.bench, self.limited, self.plain = consume, limited, plain

    def _fill(self, case: Case, count: int | None = None) -> tuple[list[str], BenchTopology]:
        topology = self.limited if case.limited else self.plain
        ids = self.bench.fill(topology, count)
        if case.returned:
            return_all(self.bench.o.amqp_url, topology, len(ids))
        self.bench.conn.execute("TRUNCATE bench_effects")
        return ids, topology

    def timed(self, case: Case) -> dict[str, Any]:
        """``outbox consume`` (a subprocess) applying the case's messages
        (``ConsumeBench.applied``), and what it left in custody."""
        ids, topology = self._fill(case)
        result = self.bench.applied(ids, queue=topology.queue)
        result["left_in_custody"] = self._in_custody()
        return result

    def traced(self, case: Case, count: int) -> dict[str, Any]:
        """The same with the consumer in this process and its session traced, from
        after its start-up (schema, policy) to its stop: per message figures."""
        ids, topology = self._fill(case, count)
        o = self.bench.o
        settings = ConsumerSettings(
            queue=topology.queue,
            dsn=self.bench.db.dsn,
            amqp_url=o.amqp_url,
            inbox_table="bench_inbox",
            prefetch=o.prefetch,
        )
        stores: list[TracedStore] = []

        def connect(s: ConsumerSettings) -> TracedStore:
            stores.append(
                TracedStore(s.dsn, s.inbox_table, s.consumer, connect_timeout=s.connect_timeout)
            )
            return stores[-1]

        inbox = Inbox(handle, settings, connect_store=connect)
        with tempfile.TemporaryFile("w+") as trace:
            inbox.start()
            stores[-1].trace(trace.fileno())
            failed: list[BaseException] = []

            def run() -> None:
                try:
                    inbox.run()
                except BaseException as exc:  # reported below, in the bench's thread
                    failed.append(exc)
                    inbox.close()

            thread = threading.Thread(target=run, name="outbox-bench-traced", daemon=True)
            thread.start()
            deadline = time.monotonic() + 600
            try:
                while self.bench.effect_count() < len(ids):
                    if failed or not thread.is_alive():
                        raise OutboxError(f"the traced consumer stopped: {failed!r}")
                    if time.monotonic() > deadline:
                        raise OutboxError("the traced consumer did not finish within 600 s")
                    time.sleep(0.05)
            finally:
                inbox.stop()
                thread.join(timeout=60)
            if len(stores) != 1:  # a second session: the figures would miss the first's
                raise OutboxError(f"the traced consumer opened {len(stores)} sessions")
            trace.seek(0)
            counted = traffic(trace)
        effects = self.bench.effects(len(ids))
        self.bench.conn.execute("TRUNCATE bench_inbox")
        return {
            "messages": len(ids),
            "exactly_once": effects["exactly_once"],
            "custody_taken": inbox.stats.custody_taken,
            "statements_per_message": round(counted.statements / len(ids), 2),
            "round_trips_per_message": round(counted.round_trips / len(ids), 2),
            "commits_per_message": round(counted.commits / len(ids), 3),
        }

    def _in_custody(self) -> int:
        row = self.bench.conn.execute(
            "SELECT to_regclass('bench_inbox_custody') IS NOT NULL AS present"
        ).fetchone()
        if not row or not row["present"]:
            return 0
        held = self.bench.conn.execute("SELECT count(*) AS n FROM bench_inbox_custody").fetchone()
        return int(held["n"]) if held else 0


def run_returned_bench(
    options: ConsumeBenchOptions, echo: Echo, *, traced_rows: int = TRACED_ROWS
) -> dict[str, Any]:
    quorum = {"x-queue-type": "quorum"}
    runs: dict[str, list[dict[str, Any]]] = {case.name: [] for case in CASES}
    traced: dict[str, dict[str, Any]] = {}
    limited_queue = {**quorum, "x-delivery-limit": DELIVERY_LIMIT}
    with consume_bench(options, echo, arguments=limited_queue) as consume:
        plain = BenchTopology(options.amqp_url, f"{uuid.uuid4().hex[:8]}.quorum", arguments=quorum)
        bench = ReturnedBench(consume, consume.broker, plain)
        try:
            for i in range(options.repeats):
                for case in CASES[i % len(CASES) :] + CASES[: i % len(CASES)]:
                    runs[case.name].append(bench.timed(case))
                    rate = runs[case.name][-1]["rate"]
                    echo(f"  {case.name:<11} run {i + 1}: {rate:,.0f} effects/s")
            count = min(traced_rows, options.rows)
            for case in CASES:
                echo(f"  {case.name:<11} traced ({count} messages) ...")
                traced[case.name] = bench.traced(case, count)
            about = consume.about()
        finally:
            plain.delete()
    medians = {name: statistics.median(r["rate"] for r in rs) for name, rs in runs.items()}

    def ratio(a: str, b: str) -> float | None:
        return round(medians[a] / medians[b], 3) if medians[b] else None

    expected_taken = {
        case.name: traced[case.name]["messages"] if case.name == "custody" else 0 for case in CASES
    }
    return {
        **about,
        "delivery_limit": DELIVERY_LIMIT,
        "cases": {
            case.name: {
                "label": case.label,
                "effects_per_s": [round(r["rate"]) for r in runs[case.name]],
                "median": round(medians[case.name]),
                **cpu_medians("run", runs[case.name]),
                "traced": traced[case.name],
            }
            for case in CASES
        },
        "custody_to_redelivered": ratio("custody", "redelivered"),
        "custody_to_first": ratio("custody", "first"),
        "every_message_once": all(
            r["exactly_once"] and r["left_in_custody"] == 0 for rs in runs.values() for r in rs
        )
        and all(
            t["exactly_once"] and t["custody_taken"] == expected_taken[name]
            for name, t in traced.items()
        ),
    }


def render(report: dict[str, Any]) -> str:
    cases = report["cases"]
    custody = cases["custody"]["median"]
    lines = [
        f"outbox bench --consume-returned: {report['rows']} messages of "
        f"{report['payload_bytes']} B a case, prefetch {report['prefetch']}, "
        f"x-delivery-limit {report['delivery_limit']}, {report['machine']['cpus']} CPUs, "
        f"PostgreSQL {report['server_version']} ({report['machine']['postgres']}), "
        f"medians of {report['repeats']}",
        "",
        "| messages; queue: path | effects/s | custody ÷ this | CPU s per 10k "
        "(consumer + PostgreSQL) | statements / round trips / COMMITs per message |",
        "|---|---:|---:|---:|---|",
    ]
    for case in CASES:
        c, t = cases[case.name], cases[case.name]["traced"]
        share = f"{custody / c['median']:.2f}" if c["median"] else "-"
        lines.append(
            f"| {c['label']} | {c['median']:,} | {share} | {cpu_cell(c, 'run', '')} | "
            f"{t['statements_per_message']:.2f} / {t['round_trips_per_message']:.2f} / "
            f"{t['commits_per_message']:.2f} |"
        )
    lines += [
        "",
        "runs: "
        + "; ".join(
            f"{case.name} " + " / ".join(f"{r:,}" for r in cases[case.name]["effects_per_s"])
            for case in CASES
        ),
        "per message: from libpq's trace of the consumer's session, "
        + ", ".join(
            f"{case.name} {cases[case.name]['traced']['messages']} messages "
            f"({cases[case.name]['traced']['custody_taken']} taken into custody)"
            for case in CASES
        ),
        "every message had exactly one effect, custody left empty"
        if report["every_message_once"]
        else "MESSAGES MISSING OR DOUBLED, OR A CASE TOOK ANOTHER PATH",
    ]
    return "\n".join(lines)
