"""``outbox bench``, the production load shape: bursty writers while relays run.

The throughput runs commit a whole backlog at once and time its drain.  Production
looks different, and that difference hid the worst bug this project had (the
claim's plan collapsing on an outbox whose statistics say "nearly empty"):

- application threads commit bursts (``rows_per_commit`` rows, then a pause of
  about ``pause`` seconds, jittered) *while* the relays run;
- the table is churned and never vacuumed by the bench: autovacuum and ANALYZE
  run when PostgreSQL decides, so the statistics go stale as they do in
  production;
- the relays are started and registered before the first commit, so start-up is
  not timed.

Per relay count it reports msg/s (first commit to empty table), duplicates (messages
on the queue beyond the rows committed), how long the table took to empty after the
last commit, the slowest claim and the batches rolled back (from each relay's
``relay.stopped`` log event).  With no fault injected, duplicates and rollbacks
must be 0.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import threading
import time
from typing import TYPE_CHECKING, Any

from outbox.db import session
from outbox.errors import OutboxError

if TYPE_CHECKING:
    from outbox.bench.harness import Bench


@dataclasses.dataclass(frozen=True)
class BurstShape:
    writers: int = 8
    rows_per_commit: int = 250
    pause: float = 1.5  # seconds between one writer's commits (uniform 0.5x..1.5x)


@dataclasses.dataclass
class BurstRun:
    relays: int
    rows: int
    seconds: float  # first commit → empty table
    drain_after_last_commit: float
    delivered: int
    slowest_claim_ms: float
    rolled_back: int

    @property
    def rate(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    @property
    def duplicates(self) -> int:
        return max(0, self.delivered - self.rows)


class _Writers:
    """``writers`` threads, each committing ``commits`` bursts with pauses."""

    def __init__(self, bench: Bench, shape: BurstShape, rows: int, seed: int) -> None:
        self.bench, self.shape = bench, shape
        per_writer = max(1, rows // (shape.writers * shape.rows_per_commit))
        self.commits = [per_writer] * shape.writers
        self.rows = per_writer * shape.writers * shape.rows_per_commit
        self.last_commit = 0.0
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._threads = [
            threading.Thread(target=self._write, args=(n,), daemon=True)
            for n in range(shape.writers)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def join(self) -> None:
        for thread in self._threads:
            thread.join()
        if self.errors:
            raise OutboxError(f"a bench writer failed: {self.errors[0]}")

    def _write(self, n: int) -> None:
        db, shape = self.bench.db, self.shape
        with self._lock:
            pauses = [shape.pause * self._rng.uniform(0.5, 1.5) for _ in range(self.commits[n])]
        try:
            conn = session.connect(db.dsn, application_name=f"outbox-bench-writer-{n}")
        except BaseException as exc:
            self.errors.append(exc)
            return
        try:
            for i, pause in enumerate(pauses):
                if i:
                    time.sleep(pause)
                with conn.transaction():
                    conn.execute(
                        f'INSERT INTO "{db.table}" (exchange, routing_key, payload) '
                        "SELECT %s, 'bench.' || (i %% 16), "
                        "convert_to(rpad(i::text || ':', %s, 'x'), 'UTF8') "
                        "FROM generate_series(1, %s) AS i",
                        [self.bench.broker.exchange, self.bench.o.payload, shape.rows_per_commit],
                    )
                now = time.perf_counter()
                with self._lock:
                    self.last_commit = max(self.last_commit, now)
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            conn.close()


def bursty_run(bench: Bench, relay_count: int, shape: BurstShape, seed: int) -> BurstRun:
    """One run: relays running, writers committing bursts, until the table is empty."""
    from outbox.bench.harness import RelayProcesses, wait_registered

    db, broker = bench.db, bench.broker
    broker.purge()
    relays = RelayProcesses(bench.settings(), relay_count, log_level="info", log_format="json")
    try:
        wait_registered(bench.conn, db.table, relay_count, relays)
        writers = _Writers(bench, shape, bench.o.rows, seed)
        started = time.perf_counter()
        writers.start()
        writers.join()
        deadline = time.monotonic() + 300
        while True:
            row = bench.conn.execute(
                f'SELECT EXISTS (SELECT 1 FROM "{db.table}") AS waiting'
            ).fetchone()
            if row and not row["waiting"]:
                break
            if time.monotonic() > deadline:
                raise OutboxError("relays left rows after 300 s")
            relays.check_alive()
            time.sleep(0.01)
        emptied = time.perf_counter()
    finally:
        events = relays.stop()
    bench.conn.execute(f'DELETE FROM "{db.table}_relays"')
    delivered = broker.depth()
    broker.purge()
    return BurstRun(
        relays=relay_count,
        rows=writers.rows,
        seconds=emptied - started,
        drain_after_last_commit=emptied - writers.last_commit,
        delivered=delivered,
        slowest_claim_ms=max((float(e.get("slowest_claim_ms", 0)) for e in events), default=0),
        rolled_back=sum(int(e.get("rolled_back", 0)) for e in events),
    )


def measure_bursts(
    bench: Bench, counts: tuple[int, ...], repeats: int, shape: BurstShape, echo: Any
) -> list[dict[str, Any]]:
    """Every relay count ``repeats`` times, in rounds; the figure of a count is its median."""
    runs: dict[int, list[BurstRun]] = {count: [] for count in counts}
    for i in range(repeats):
        for count in counts:
            run = bursty_run(bench, count, shape, seed=i)
            runs[count].append(run)
            echo(
                f"  bursty writers, {count} relay(s) run {i + 1}: {run.rate:,.0f} msg/s, "
                f"{run.duplicates} duplicates, empty {run.drain_after_last_commit:.2f} s after "
                f"the last commit, slowest claim {run.slowest_claim_ms:.0f} ms"
            )
    base = statistics.median(r.rate for r in runs[counts[0]])
    return [
        {
            "relays": count,
            "rows": runs[count][0].rows,
            "msg_per_s": round(statistics.median(r.rate for r in runs[count])),
            "ratio_to_first": round(statistics.median(r.rate for r in runs[count]) / base, 3)
            if base
            else 0.0,
            "duplicates": max(r.duplicates for r in runs[count]),
            "delivered_min": min(r.delivered for r in runs[count]),
            "drain_after_last_commit_s": round(
                statistics.median(r.drain_after_last_commit for r in runs[count]), 3
            ),
            "drain_after_last_commit_max_s": round(
                max(r.drain_after_last_commit for r in runs[count]), 3
            ),
            "slowest_claim_ms": round(max(r.slowest_claim_ms for r in runs[count]), 1),
            "rolled_back": sum(r.rolled_back for r in runs[count]),
        }
        for count in counts
    ]


def render_bursts(rows: list[dict[str, Any]], shape: dict[str, Any], repeats: int) -> list[str]:
    lines = [
        "",
        f"bursty writers while relays run ({shape['writers']} writers x "
        f"{shape['rows_per_commit']} rows every ~{shape['pause']} s, table churned and "
        f"never vacuumed by the bench; medians of {repeats})",
        "",
        "| relays | msg/s | vs first | duplicates | empty after last commit (median / max) "
        "| slowest claim | rolled back |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['relays']} | {r['msg_per_s']:,} | {r['ratio_to_first']:.2f} | "
            f"{r['duplicates']} | {r['drain_after_last_commit_s']:.2f} s / "
            f"{r['drain_after_last_commit_max_s']:.2f} s | {r['slowest_claim_ms']:.0f} ms | "
            f"{r['rolled_back']} |"
        )
    return lines
