"""``outbox bench``: the relay next to a bare pika publisher, in one run.

Measures, against the same PostgreSQL and RabbitMQ:

1. **Throughput.**  A bare publisher (pika, persistent messages, ``mandatory``,
   publisher confirms pipelined over a sliding window) sends ``rows`` messages of
   ``payload`` bytes; then relays drain the same number of such rows from the
   outbox table.  Runs alternate (bare, relay, bare, relay, …) so both see the
   same background load; the ratio is taken from the medians.  Then relays x batch
   sizes for scaling, each cell ``repeats`` times (medians), with how busy the
   machine's CPUs were during each run, and for each relay count N, N bare
   publishers sending in parallel (``outbox.bench.publishers``): the broker's
   ingest from N connections, the fair baseline of N relays.
2. **Latency.**  One idle relay; the bench commits single-row transactions at a
   fixed rate (from one application process per 500 commits/s) and a consumer
   timestamps each message: commit returned → message received (same clock, same
   process).  It reports the rate reached and the CPU per 10,000 messages too.
   ``--no-latency`` skips it and the idle run.
3. **Idle cost.**  The relay left alone: its CPU (``/proc/<pid>/stat``) and the
   transactions its database ran (``pg_stat_database``).
4. **Memory.**  The relay's peak RSS draining backlogs of 1 KiB, 1 MiB and 8 MiB
   rows with default settings (``outbox.bench.memory``; ``--memory-only`` with
   ``--memory-backlogs`` measures any backlog, e.g. ``1000x8MiB+1x64MiB``).

Relays run as subprocesses (``python -m outbox relay``), exactly as deployed: each
gets its own interpreter and GIL, so 2 or 4 relays measure the design rather than
Python threads fighting over one GIL, and the bench's own consumer and polling do
not steal the relay's CPU time.  Startup (imports, connecting) is kept out of the
figures: relays are started and registered before the rows are committed, and the
clock starts when that commit returns (the NOTIFY wakes them).

The harness (servers, relays as subprocesses, the bare publisher) is
``outbox.bench.harness``.  Benchmarks print figures; nothing here is a timed
assertion.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import uuid
from typing import Any

from outbox.bench import memory as bench_memory
from outbox.bench.harness import (
    Bench,
    BenchOptions,
    BenchTopology,
    Database,
    Echo,
    Run,
    bench_database,
)
from outbox.bench.load import BurstShape, measure_bursts, render_bursts
from outbox.bench.ordering import measure_ordering, render_ordering
from outbox.bench.publishers import parallel_bare
from outbox.config import Settings


def run_bench(options: BenchOptions, echo: Echo) -> dict[str, Any]:
    """Every measurement; returns the figures (``--json`` prints them as they are)."""
    suffix = uuid.uuid4().hex[:8]
    with bench_database(options.dsn, echo) as db:
        if options.memory_only:
            return _measure_memory(options, db, echo)
        broker = BenchTopology(options.amqp_url, suffix)
        bench = Bench(options, db, broker, echo)
        try:
            if options.latency_only:
                return _measure_latency(bench, db, echo)
            return _measure(bench, options, db, echo)
        finally:
            bench.close()
            broker.delete()


def _memory(o: BenchOptions, db: Database, echo: Echo) -> list[dict[str, Any]]:
    echo("  peak memory of one relay draining large rows ...")
    runs = bench_memory.measure_all(db.dsn, db.table, o.amqp_url, o.memory_backlogs, echo)
    return [run.as_dict() for run in runs]


def _measure_memory(o: BenchOptions, db: Database, echo: Echo) -> dict[str, Any]:
    memory = _memory(o, db, echo)
    return {
        "machine": {"cpus": os.cpu_count(), "postgres": db.description},
        "memory": memory,
        "every_row_arrived": all(m["exactly_once"] for m in memory),
    }


def _measure_latency(bench: Bench, db: Database, echo: Echo) -> dict[str, Any]:
    """``--latency-only``: the latency rounds, nothing else."""
    echo("  latency rounds ...")
    latency = bench.latency()
    return {
        "machine": {"cpus": os.cpu_count(), "postgres": db.description},
        "load_average": os.getloadavg(),
        "latency": {k: v for k, v in latency.items() if k != "idle"},
        "every_row_arrived": _latency_arrived(latency),
    }


def _latency_arrived(latency: dict[str, Any]) -> bool:
    return bool(
        latency["delivered"] == latency["sent"]
        and latency["baseline"]["delivered"] == latency["baseline"]["sent"]
    )


def _measure(bench: Bench, o: BenchOptions, db: Database, echo: Echo) -> dict[str, Any]:
    server = bench.conn.execute("SHOW server_version").fetchone()
    bare_runs: list[Run] = []
    relay_runs: list[Run] = []
    for i in range(o.repeats):
        bare_runs.append(bench.bare())
        echo(f"  bare publisher  run {i + 1}: {bare_runs[-1].rate:,.0f} msg/s")
        relay_runs.append(bench.relay(1))
        echo(f"  1 relay         run {i + 1}: {relay_runs[-1].rate:,.0f} msg/s")
    bare_rate = statistics.median(r.rate for r in bare_runs)
    relay_rate = statistics.median(r.rate for r in relay_runs)
    # The scaling grid: every cell ``repeats`` times, in rounds (each round visits
    # every cell once), so slow drifts of the machine hit every cell alike; the
    # figure of a cell is its median.  The 1-relay default cell reuses the runs above.
    # Each round runs, per relay count N, N bare publishers in parallel first (the
    # fair baseline of N relays: as many connections and confirm windows).
    default_batch = Settings().batch_size
    counts = list(dict.fromkeys(o.relays)) if o.scaling else []
    cells = [(count, batch) for count in counts for batch in dict.fromkeys(o.batch_sizes)]
    grid: dict[tuple[int, int], list[Run]] = {
        cell: list(relay_runs) if cell == (1, default_batch) else [] for cell in cells
    }
    parallel: dict[int, list[Run]] = {count: [] for count in counts}
    parallel_runs: list[Run] = []
    for i in range(o.repeats):
        for count in counts:
            run = parallel_bare(bench, count)
            parallel[count].append(run)
            parallel_runs.append(run)
            echo(f"  {count} bare publisher(s) in parallel run {i + 1}: {run.rate:,.0f} msg/s")
            for cell in cells:
                if cell[0] != count or len(grid[cell]) > i:
                    continue
                run = bench.relay(*cell)
                grid[cell].append(run)
                relay_runs.append(run)
                echo(
                    f"  {cell[0]} relay(s), batch {cell[1]} run {i + 1}: {run.rate:,.0f} msg/s, "
                    f"machine {100 * run.machine_busy:.0f}% busy"
                )
    scaling = []
    for count, batch_size in cells:
        runs = grid[(count, batch_size)]
        run_rate = statistics.median(r.rate for r in runs)
        parallel_rate = statistics.median(r.rate for r in parallel[count])
        scaling.append(
            {
                "relays": count,
                "batch_size": batch_size,
                "msg_per_s": round(run_rate),
                "runs_msg_per_s": [round(r.rate) for r in runs],
                "ratio_to_bare": ratio(run_rate, bare_rate),
                # N relays against N bare publishers in parallel (N connections).
                "parallel_bare_msg_per_s": round(parallel_rate),
                "parallel_bare_runs_msg_per_s": [round(r.rate) for r in parallel[count]],
                "ratio_to_parallel_bare": ratio(run_rate, parallel_rate),
                "parallel_bare_cpu_s_per_10k": cpu_figures(parallel[count])["cpu_s_per_10k"],
                "machine_busy_percent": round(
                    100 * statistics.median(r.machine_busy for r in runs), 1
                ),
                "relay_cpu_seconds": round(statistics.median(r.relay_cpu_seconds for r in runs), 2),
                **cpu_figures(runs),
                "delivered": min(r.delivered for r in runs),
            }
        )
        echo(
            f"  {count} relay(s), batch {batch_size}: median {run_rate:,.0f} msg/s, "
            f"{count} bare publisher(s) in parallel {parallel_rate:,.0f} msg/s"
        )
    bursts: list[dict[str, Any]] = []
    shape = BurstShape(o.burst_writers, o.burst_rows, o.burst_pause)
    if o.bursts:
        bursts = measure_bursts(bench, o.relays, o.repeats, shape, echo)
    ordering = measure_ordering(bench, o.repeats, echo) if o.ordering else None
    latency: dict[str, Any] | None = None
    if o.latency:
        echo("  latency and idle run ...")
        latency = bench.latency()
    memory = _memory(o, db, echo) if o.memory else []
    every_row = (
        all(r.delivered == r.rows for r in bare_runs + relay_runs + parallel_runs)
        and all(b["delivered_min"] >= b["rows"] for b in bursts)
        and all(s["delivered_min"] >= s["rows"] for s in (ordering or {}).get("shapes", []))
        and (latency is None or _latency_arrived(latency))
        and all(m["exactly_once"] for m in memory)
    )
    return {
        "machine": {"cpus": os.cpu_count(), "postgres": db.description},
        "server_version": server["server_version"] if server else None,
        "rows": o.rows,
        "payload_bytes": o.payload,
        "repeats": o.repeats,
        "throughput": {
            "bare_msg_per_s": [round(r.rate) for r in bare_runs],
            "relay_msg_per_s": [round(r.rate) for r in relay_runs[: o.repeats]],
            "bare_median": round(bare_rate),
            "relay_median": round(relay_rate),
            "ratio": ratio(relay_rate, bare_rate),
            "window": o.window,
            "bare_cpu_s_per_10k": cpu_figures(bare_runs)["cpu_s_per_10k"],
            **{f"relay_{k}": v for k, v in cpu_figures(relay_runs[: o.repeats]).items()},
        },
        "scaling": scaling,
        "bursts": bursts,
        "burst_shape": dataclasses.asdict(shape),
        "ordering": ordering,
        "latency": None if latency is None else {k: v for k, v in latency.items() if k != "idle"},
        "idle": None if latency is None else latency["idle"],
        "memory": memory,
        "every_row_arrived": every_row,
    }


def _baseline_lines(lat: dict[str, Any]) -> list[str]:
    """The latency run's baseline (``outbox.bench.poller``) and the relay's ratio to it."""
    base = lat.get("baseline")
    if not base:
        return []

    def ratio(q: str) -> str:
        return f"{lat[q] / base[q]:.2f}x" if base.get(q) else "-"

    return [
        f"  same producers, the relay's loop without two-phase commit (claim, publish, "
        f"confirms, COMMIT; no PREPARE, no ledger), {base['delivered']}/{base['sent']} "
        f"delivered: p50 {base['p50_ms']} ms, p95 {base['p95_ms']} ms, p99 {base['p99_ms']} "
        f"ms, max {base['max_ms']} ms; {base['committed_per_s']} commits/s reached; "
        f"the relay at {ratio('p50_ms')} its p50, {ratio('p99_ms')} its p99",
    ]


def ratio(numerator: float, denominator: float) -> float | None:
    """``numerator / denominator`` to three places; None when there is nothing to
    divide by (a run that sent nothing)."""
    if denominator <= 0:
        return None
    return round(numerator / denominator, 3)


def _ratio_cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known and len(known) == len(values) else None


def cpu_figures(runs: list[Run]) -> dict[str, float | None]:
    """Medians of the CPU seconds per 10,000 messages (``/proc``): the publishing
    process (a relay, or the bench's own process for the bare publisher), the relays'
    PostgreSQL backends (None: not on this machine, or the bare publisher), both."""
    own = _median([r.cpu_per_10k for r in runs])
    backends = _median([r.backend_cpu_per_10k for r in runs])
    both = _median(
        [
            r.cpu_per_10k + r.backend_cpu_per_10k
            if r.cpu_per_10k is not None and r.backend_cpu_per_10k is not None
            else None
            for r in runs
        ]
    )
    return {"cpu_s_per_10k": own, "backend_cpu_s_per_10k": backends, "total_cpu_s_per_10k": both}


def _cpu_cell(own: float | None, backends: float | None = None) -> str:
    if own is None:
        return "-"
    if backends is None:
        return f"{own:.2f}"
    return f"{own + backends:.2f} ({own:.2f} + {backends:.2f} PostgreSQL)"


def render(report: dict[str, Any]) -> str:
    if "throughput" not in report and "latency" in report:  # --latency-only
        return "\n".join(
            [
                f"outbox bench --latency-only: {report['machine']['cpus']} CPUs, "
                f"PostgreSQL {report['machine']['postgres']}, load average at the end "
                + " / ".join(f"{v:.2f}" for v in report["load_average"]),
                *_latency_lines(report["latency"], None),
                "",
                "every row arrived exactly once" if report["every_row_arrived"] else "ROWS MISSING",
            ]
        )
    if "throughput" not in report:  # --memory-only
        lines = [
            f"outbox bench --memory-only: {report['machine']['cpus']} CPUs, "
            f"PostgreSQL {report['machine']['postgres']}",
            *bench_memory.render(report["memory"]),
            "",
            "every row arrived exactly once" if report["every_row_arrived"] else "ROWS MISSING",
        ]
        return "\n".join(lines)
    t, lat, idle = report["throughput"], report["latency"], report["idle"]
    lines = [
        f"outbox bench: {report['rows']} rows of {report['payload_bytes']} B, "
        f"{report['machine']['cpus']} CPUs, PostgreSQL {report['server_version']} "
        f"({report['machine']['postgres']}), medians of {report['repeats']}",
        "",
        "| what | msg/s | ratio to bare | CPU s per 10,000 msgs |",
        "|---|---:|---:|---:|",
        f"| bare pika publisher (confirms, window {t['window']}) | {t['bare_median']:,} | 1.00 "
        f"| {_cpu_cell(t.get('bare_cpu_s_per_10k'))} |",
        f"| 1 relay, default settings | {t['relay_median']:,} | {_ratio_cell(t['ratio'])} "
        f"| {_cpu_cell(t.get('relay_cpu_s_per_10k'), t.get('relay_backend_cpu_s_per_10k'))} |",
        "",
        "CPU: user + system seconds from /proc, of the publishing process (the bare "
        "publisher's is the bench's own), plus the relay's PostgreSQL backends",
    ]
    if report["scaling"]:
        lines += [
            "",
            f"scaling (medians of {report['repeats']}; N bare = as many bare publishers as "
            "relays, in parallel, each in its own process with its own connection; "
            "machine = share of all CPUs busy)",
            "",
            "| relays | batch | msg/s | N bare msg/s | ratio to N bare | ratio to 1 bare "
            "| runs | N bare runs | machine busy | relay CPU s | CPU s per 10,000 msgs "
            "| N bare CPU s per 10,000 msgs |",
            "|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|",
        ]
    for s in report["scaling"]:
        runs = " / ".join(f"{r:,}" for r in s["runs_msg_per_s"])
        parallel_runs = " / ".join(f"{r:,}" for r in s["parallel_bare_runs_msg_per_s"])
        lines.append(
            f"| {s['relays']} | {s['batch_size']} | {s['msg_per_s']:,} | "
            f"{s['parallel_bare_msg_per_s']:,} | {_ratio_cell(s['ratio_to_parallel_bare'])} | "
            f"{_ratio_cell(s['ratio_to_bare'])} | {runs} | {parallel_runs} | "
            f"{s['machine_busy_percent']:.0f}% | "
            f"{s['relay_cpu_seconds']:.1f} | "
            f"{_cpu_cell(s.get('cpu_s_per_10k'), s.get('backend_cpu_s_per_10k'))} | "
            f"{_cpu_cell(s.get('parallel_bare_cpu_s_per_10k'))} |"
        )
    if report["bursts"]:
        lines += render_bursts(report["bursts"], report["burst_shape"], report["repeats"])
    if report.get("ordering"):
        lines += render_ordering(report["ordering"], report["repeats"])
    if lat is not None:
        lines += _latency_lines(lat, idle)
    if report["memory"]:
        lines += bench_memory.render(report["memory"])
    lines += [
        "",
        "every row arrived exactly once" if report["every_row_arrived"] else "ROWS MISSING",
    ]
    return "\n".join(lines)


def _latency_lines(lat: dict[str, Any], idle: dict[str, Any] | None) -> list[str]:
    lines = [
        "",
        f"latency at {lat['rate_per_s']:.0f} commits/s (commit → consumer), "
        f"{lat['delivered']}/{lat['sent']} delivered: p50 {lat['p50_ms']} ms, "
        f"p95 {lat['p95_ms']} ms, p99 {lat['p99_ms']} ms, max {lat['max_ms']} ms; "
        f"{lat.get('committed_per_s', '-')} commits/s reached; CPU s per 10,000 msgs: "
        f"{_cpu_cell(lat.get('relay_cpu_s_per_10k'), lat.get('backend_cpu_s_per_10k'))}",
        *_baseline_lines(lat),
    ]
    rounds = lat.get("rounds") or []
    if len(rounds) > 1:
        lines += _rounds_lines(lat, rounds)
    if idle is not None:
        lines.append(
            f"idle relay over {idle['seconds']} s: {idle['cpu_percent_of_a_core']}% of a core, "
            f"{idle['db_transactions_per_s']} database transactions/s"
        )
    return lines


def _rounds_lines(lat: dict[str, Any], rounds: list[dict[str, Any]]) -> list[str]:
    """The rounds of ``--latency-rounds``, relay and poller side by side."""

    def x(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [
        "",
        f"{len(rounds)} rounds, relay and poller alternated (ms; ratio = relay / poller; "
        "machine = share of both CPUs busy while the rows were committed):",
        "",
        "| round | first | relay p50 | relay p99 | poller p50 | poller p99 | ratio p50 "
        "| ratio p99 | commits/s relay / poller | machine busy relay / poller |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for number, r in enumerate(rounds, 1):
        relay, poller = r["relay"], r["poller"]
        lines.append(
            f"| {number} | {r['first']} | {relay['p50_ms']} | {relay['p99_ms']} "
            f"| {poller['p50_ms']} | {poller['p99_ms']} | {x(r['ratio_p50'])} "
            f"| {x(r['ratio_p99'])} | {relay['committed_per_s']} / {poller['committed_per_s']} "
            f"| {relay.get('machine_busy_percent', '-')}% / "
            f"{poller.get('machine_busy_percent', '-')}% |"
        )
    p50s = [r["ratio_p50"] for r in rounds if r["ratio_p50"] is not None]
    p99s = [r["ratio_p99"] for r in rounds if r["ratio_p99"] is not None]

    def span(values: list[float]) -> str:
        return f" ({min(values):.2f}-{max(values):.2f})" if values else ""

    lines += [
        "",
        f"median ratio relay / poller: p50 {x(lat.get('ratio_p50_median'))}{span(p50s)}, "
        f"p99 {x(lat.get('ratio_p99_median'))}{span(p99s)}",
    ]
    return lines
