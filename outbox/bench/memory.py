"""The relay's peak memory (RSS) while it drains a backlog of large rows.

A backlog (``Backlog``: so many rows of so many bytes, plus perhaps a few larger
ones) is committed to the outbox table first; then ``outbox relay --drain`` runs
as a subprocess with default settings, exactly as deployed, until the table is
empty.  Its peak resident set size is the process's own ``VmHWM`` as it exits
(``_RELAY_REPORTING_PEAK``).  Every message is then read back from the queue:
each row must have arrived exactly once.

Payloads are random bytes (written once by the client, copied row to row by the
server with the row's number in front), so PostgreSQL stores them uncompressed,
as it would a real backlog of images or documents.

``outbox bench`` reports these figures for 1 KiB, 1 MiB and 8 MiB payloads;
``outbox bench --memory-only --memory-backlogs 1000x8MiB+1x64MiB`` measures any
backlog.
Benchmarks print figures; nothing here asserts on them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from outbox.config import Settings
from outbox.db import session
from outbox.errors import OutboxError

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
_UNITS = {"": 1, "b": 1, "k": KIB, "kib": KIB, "m": MIB, "mib": MIB, "g": GIB, "gib": GIB}
_SIZE = re.compile(r"^\s*([0-9]+)\s*([a-z]*)\s*$", re.IGNORECASE)
_PART = re.compile(r"^\s*([0-9]+)\s*x\s*(.+)$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``8MiB`` → 8388608 (B, KiB, MiB, GiB; K, M, G are the same binary units)."""
    match = _SIZE.match(text)
    if not match or match[2].lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 1024, 64KiB, 8MiB)")
    return int(match[1]) * _UNITS[match[2].lower()]


def format_size(size: int) -> str:
    for unit, factor in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if size >= factor and size % factor == 0:
            return f"{size // factor} {unit}"
    return f"{size} B"


@dataclasses.dataclass(frozen=True)
class Backlog:
    """Rows committed before the relay starts: ``(count, payload bytes)`` parts,
    committed in this order (so ids, and the claim's order, follow it)."""

    parts: tuple[tuple[int, int], ...]

    @classmethod
    def parse(cls, text: str) -> Backlog:
        """``1000x8MiB+1x64MiB``: 1,000 rows of 8 MiB, then one of 64 MiB."""
        parts = []
        for piece in text.split("+"):
            match = _PART.match(piece)
            if not match:
                raise ValueError(f"not a backlog: {text!r} (e.g. 1000x8MiB+1x64MiB)")
            count, size = int(match[1]), parse_size(match[2])
            if count < 1 or size < 1:
                raise ValueError(f"not a backlog: {text!r} (counts and sizes start at 1)")
            parts.append((count, size))
        return cls(tuple(parts))

    @property
    def rows(self) -> int:
        return sum(count for count, _size in self.parts)

    @property
    def bytes(self) -> int:
        return sum(count * size for count, size in self.parts)

    def describe(self) -> str:
        return " + ".join(f"{count:,} x {format_size(size)}" for count, size in self.parts)


# What ``outbox bench`` measures by default: a few batches' worth of each size.
DEFAULT_BACKLOGS = "20000x1KiB,64x1MiB,24x8MiB"


@dataclasses.dataclass
class MemoryRun:
    backlog: Backlog
    peak_rss: int  # bytes
    seconds: float  # relay process start → exit
    exit_code: int
    delivered: int  # messages read back from the queue
    distinct: int  # distinct rows among them, each with its payload's size
    expected: int
    stopped: Mapping[str, Any]  # the relay's ``relay.stopped`` event
    log: str = ""  # the end of the relay's log

    @property
    def exactly_once(self) -> bool:
        return self.exit_code == 0 and self.delivered == self.distinct == self.expected

    def as_dict(self) -> dict[str, Any]:
        return {
            "backlog": self.backlog.describe(),
            "rows": self.backlog.rows,
            "payload_bytes": self.backlog.bytes,
            "peak_rss_bytes": self.peak_rss,
            "peak_rss_mib": round(self.peak_rss / MIB, 1),
            "seconds": round(self.seconds, 1),
            "exit_code": self.exit_code,
            "delivered": self.delivered,
            "exactly_once": self.exactly_once,
            "batches_committed": self.stopped.get("committed"),
            "largest_claim": self.stopped.get("largest_claim"),
        }


def fill(conn: session.Conn, table: str, exchange: str, backlog: Backlog) -> dict[str, int]:
    """Commit the backlog; returns {message_id (str): payload size}.

    Each size's random payload crosses the wire once; the server copies it for
    every further row, with the row's number in its first 8 bytes.
    """
    expected: dict[str, int] = {}
    for count, size in backlog.parts:
        template = os.urandom(size)
        with conn.transaction():
            conn.execute(
                "CREATE TEMP TABLE IF NOT EXISTS bench_memory_template (payload bytea)"
                " ON COMMIT DROP"
            )
            conn.execute("INSERT INTO bench_memory_template VALUES (%s)", [template])
            del template
            done = 0
            while done < count:
                # A few hundred MiB per statement keeps the server's memory small.
                step = max(1, min(count - done, (256 * MIB) // size))
                ids = [uuid.uuid4() for _ in range(step)]
                conn.execute(
                    f'INSERT INTO "{table}" (message_id, exchange, routing_key, payload) '
                    "SELECT m.id, %s, 'memory', "
                    "CASE WHEN octet_length(t.payload) >= 8 "
                    "THEN overlay(t.payload PLACING int8send(%s + m.n) FROM 1) "
                    "ELSE t.payload END "
                    "FROM bench_memory_template t, "
                    "unnest(%s::uuid[]) WITH ORDINALITY AS m(id, n)",
                    [exchange, len(expected), ids],
                )
                expected.update((str(i), size) for i in ids)
                done += step
    return expected


def _relay_env(settings: Settings) -> dict[str, str]:
    env = dict(os.environ)
    for field in dataclasses.fields(Settings):
        value = getattr(settings, field.name)
        env.pop(f"OUTBOX_{field.name.upper()}", None)
        if value is not None:
            env[f"OUTBOX_{field.name.upper()}"] = str(value)
    env["OUTBOX_LOG_LEVEL"] = os.environ.get("OUTBOX_BENCH_MEMORY_LOG_LEVEL", "info")
    env["OUTBOX_LOG_FORMAT"] = "json"
    return env


# ``outbox relay`` as a script that says its peak RSS as it exits.  The kernel's
# figure for a finished child (``ru_maxrss``) will not do: it counts the memory
# the child had before it exec'd, i.e. a copy of whatever process forked it (the
# bench, or pytest).  ``VmHWM`` belongs to the process's current image only.
_RELAY_REPORTING_PEAK = """
import atexit, json, sys

def _peak():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                kib = int(line.split()[1])
                sys.stderr.write(json.dumps({"event": "bench.peak_rss", "kib": kib}) + "\\n")
                sys.stderr.flush()

atexit.register(_peak)
from outbox.cli import main
main(sys.argv[1:])
"""


def drain_peak_rss(
    settings: Settings, *, timeout: float = 3600.0
) -> tuple[int, int, float, dict[str, Any], str]:
    """Run ``outbox relay --drain`` to its end: (peak RSS in bytes, exit code,
    seconds, its ``relay.stopped`` event, the tail of its log)."""
    with tempfile.TemporaryFile() as log:
        started = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-c", _RELAY_REPORTING_PEAK, "relay", "--drain"],
            env=_relay_env(settings),
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        seconds = time.perf_counter() - started
        log.seek(0)
        text = log.read().decode(errors="replace")
    stopped: dict[str, Any] = {}
    peak = 0
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict) and entry.get("event") == "relay.stopped":
                stopped = entry
            if isinstance(entry, dict) and entry.get("event") == "bench.peak_rss":
                peak = int(entry["kib"]) * 1024
    return peak, code, seconds, stopped, text[-3000:]


def read_back(
    amqp_url: str, queue: str, expected: int, *, idle: float = 10.0
) -> list[tuple[str, int]]:
    """(message id, body size) of the messages on ``queue`` (consumed): ``expected``
    of them, and any more already there (duplicates: id ``<extra>``)."""
    import pika  # not at import time: the CLI imports this module for its defaults

    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = conn.channel()
        channel.basic_qos(prefetch_count=4)  # large messages: a few at a time
        ids: list[tuple[str, int]] = []
        for method, props, body in channel.consume(queue, inactivity_timeout=idle):
            if method is None:
                break
            ids.append((props.message_id, len(body)))
            channel.basic_ack(method.delivery_tag)
            if len(ids) >= expected:
                break
        channel.cancel()  # unacked deliveries go back to the queue
        left = channel.queue_declare(queue, passive=True).method.message_count
        return ids + [("<extra>", 0)] * left
    finally:
        with contextlib.suppress(Exception):
            conn.close()


@contextlib.contextmanager
def _topology(amqp_url: str) -> Iterator[tuple[str, str, str]]:
    import pika

    suffix = uuid.uuid4().hex[:8]
    exchange, queue, ledger = (
        f"outbox.bench.memory.{suffix}",
        f"outbox.bench.memory.{suffix}",
        f"outbox.bench.memory.ledger.{suffix}",
    )

    def channel() -> Any:
        return pika.BlockingConnection(pika.URLParameters(amqp_url)).channel()

    # A connection of its own each time: one left idle during a long drain misses
    # its heartbeats and is closed by the broker.
    declare = channel()
    declare.exchange_declare(exchange, "topic", durable=True)
    declare.queue_declare(queue, durable=True)
    declare.queue_bind(queue, exchange, "#")
    declare.connection.close()
    try:
        yield exchange, queue, ledger
    finally:
        with contextlib.suppress(Exception):
            cleanup = channel()
            cleanup.queue_delete(queue)
            cleanup.queue_delete(ledger)
            cleanup.exchange_delete(exchange)
            cleanup.connection.close()


def measure(
    dsn: str,
    table: str,
    amqp_url: str,
    backlog: Backlog,
    *,
    settings: Mapping[str, Any] | None = None,
    echo: Callable[[str], None] = lambda _line: None,
) -> MemoryRun:
    """Commit ``backlog``, drain it with one relay (default settings unless
    ``settings`` overrides some), read every message back."""
    with _topology(amqp_url) as (exchange, queue, ledger):
        conn = session.connect(dsn, application_name="outbox-bench-memory")
        try:
            conn.execute(f'DELETE FROM "{table}"')
            echo(f"  committing {backlog.describe()} ...")
            expected = fill(conn, table, exchange, backlog)
        finally:
            conn.close()
        relay_settings = Settings(
            dsn=dsn, amqp_url=amqp_url, table=table, ledger_queue=ledger, **(settings or {})
        )
        echo("  draining with `outbox relay --drain` ...")
        peak, code, seconds, stopped, log = drain_peak_rss(relay_settings)
        if code != 0:
            raise OutboxError(f"the relay exited with {code}:\n{log}")
        ids = read_back(amqp_url, queue, len(expected))
    return MemoryRun(
        backlog=backlog,
        peak_rss=peak,
        seconds=seconds,
        exit_code=code,
        delivered=len(ids),
        distinct=len({i for i, size in ids if expected.get(i) == size}),
        expected=len(expected),
        stopped=stopped,
        log=log,
    )


def measure_all(
    dsn: str, table: str, amqp_url: str, backlogs: Sequence[Backlog], echo: Callable[[str], None]
) -> list[MemoryRun]:
    """``measure`` each backlog in turn, on the bench's database."""
    runs = []
    for backlog in backlogs:
        run = measure(dsn, table, amqp_url, backlog, echo=echo)
        echo(
            f"  {backlog.describe()}: peak RSS {_amount(run.peak_rss)}, "
            f"{'every row once' if run.exactly_once else 'ROWS MISSING OR DUPLICATED'}"
        )
        runs.append(run)
    return runs


def parse_backlogs(text: str) -> tuple[Backlog, ...]:
    """``20000x1KiB,64x1MiB``: several backlogs, measured one after the other."""
    return tuple(Backlog.parse(part) for part in text.split(",") if part.strip())


def render(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = [
        "",
        "relay peak memory draining a backlog (`outbox relay --drain`, default settings)",
        "",
        "| backlog | payload total | peak RSS | relay run s | every row once |",
        "|---|---:|---:|---:|---|",
    ]
    for run in runs:
        lines.append(
            f"| {run['backlog']} | {_amount(run['payload_bytes'])} | "
            f"{_amount(run['peak_rss_bytes'])} | {run['seconds']:.1f} | "
            f"{'yes' if run['exactly_once'] else 'NO'} |"
        )
    return lines


def _amount(size: int) -> str:
    return f"{size / KIB:,.0f} KiB" if size < MIB else f"{size / MIB:,.0f} MiB"
