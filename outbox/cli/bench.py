"""``outbox bench``: the relay and the consumer against bare clients."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import click

from outbox import urls
from outbox.bench.fleet import RUNS as FLEET_RUNS
from outbox.bench.horizon import DEFAULT_HOLDERS
from outbox.bench.memory import DEFAULT_BACKLOGS as DEFAULT_MEMORY_BACKLOGS
from outbox.cli.common import (
    known_errors,
    own_servers_options,
)
from outbox.cli.options import (
    FiniteFloatRange,
)
from outbox.config import (
    DAY,
    LIMITS,
)
from outbox.errors import ExitCode


@click.command()
@own_servers_options
@click.option(
    "--rows",
    default=20_000,
    show_default=True,
    type=click.IntRange(1, 10_000_000),
    help="Messages per throughput run.",
)
@click.option(
    "--payload",
    default=1024,
    show_default=True,
    type=click.IntRange(1, 64 * 1024 * 1024),
    help="Payload bytes per message.",
)
@click.option(
    "--repeats",
    default=3,
    show_default=True,
    type=click.IntRange(1, 100),
    help="Runs per figure (bare/relay pairs, each scaling cell): medians.",
)
@click.option(
    "--relays",
    default="1,2,4",
    show_default=True,
    help="Relay counts for the scaling runs; each N is also measured against N bare "
    "publishers sending in parallel (a process and a connection each).",
)
@click.option(
    "--batch-sizes",
    default="100,1000,5000",
    show_default=True,
    help="Batch sizes for the scaling runs.",
)
@click.option(
    "--window",
    default=1000,
    show_default=True,
    type=click.IntRange(1, 1_000_000),
    help="Bare publisher confirm window.",
)
@click.option(
    "--latency-rate",
    default=200.0,
    show_default=True,
    type=FiniteFloatRange(0, 100_000, min_open=True),
    help="Single-row commits per second.",
)
@click.option(
    "--latency-seconds",
    default=5.0,
    show_default=True,
    type=FiniteFloatRange(0, DAY, min_open=True),
    help="Length of the latency run.",
)
@click.option(
    "--latency-rounds",
    default=1,
    show_default=True,
    type=click.IntRange(1, 100),
    help="Latency rounds, the relay and the poller without two-phase commit alternated "
    "(relay first, then poller first, …): per-round p50/p99 and the median ratios.",
)
@click.option(
    "--latency-only",
    is_flag=True,
    help="Instead: only the latency rounds (--latency-rounds, --latency-rate), no idle run.",
)
@click.option(
    "--idle-seconds",
    default=12.0,
    show_default=True,
    type=FiniteFloatRange(0, DAY, min_open=True),
    help="Length of the idle run.",
)
@click.option(
    "--burst-writers",
    default=8,
    show_default=True,
    type=click.IntRange(1, 256),
    help="Bursty load: writer threads.",
)
@click.option(
    "--burst-rows",
    default=250,
    show_default=True,
    type=click.IntRange(1, 1_000_000),
    help="Bursty load: rows per commit.",
)
@click.option(
    "--burst-pause",
    default=1.5,
    show_default=True,
    type=FiniteFloatRange(0, DAY),
    help="Bursty load: seconds between one writer's commits (jittered).",
)
@click.option(
    "--scaling/--no-scaling", default=True, show_default=True, help="Run the scaling grid."
)
@click.option(
    "--bursts/--no-bursts", default=True, show_default=True, help="Run the bursty-writers load."
)
@click.option(
    "--ordering/--no-ordering",
    default=True,
    show_default=True,
    help="Run the per-key ordering shapes (unordered, 1,000 keys, one hot key).",
)
@click.option(
    "--latency/--no-latency",
    default=True,
    show_default=True,
    help="Run the latency run and the idle run (about 35 s at the defaults).",
)
@click.option(
    "--memory/--no-memory",
    default=True,
    show_default=True,
    help="Measure the relay's peak RSS draining large rows.",
)
@click.option(
    "--memory-backlogs",
    default=DEFAULT_MEMORY_BACKLOGS,
    show_default=True,
    help="Backlogs for the peak-RSS runs, each drained by one relay with default "
    "settings: COUNTxSIZE[+COUNTxSIZE…], comma-separated (e.g. 1000x8MiB+1x64MiB).",
)
@click.option(
    "--memory-only",
    is_flag=True,
    help="Instead: only the peak-RSS runs.",
)
@click.option(
    "--consume",
    is_flag=True,
    help="Instead: `outbox consume` (effects/s) against a bare kombu consumer (msg/s).",
)
@click.option(
    "--consume-returned",
    is_flag=True,
    help="Instead: what custody costs `outbox consume` per message: --rows messages the "
    "broker returned once, on a quorum queue with x-delivery-limit (custody) and on one "
    "without (applied alone), against first deliveries (the batch path); effects/s, CPU, "
    "and statements and round trips per message (libpq's trace of the consumer's session).",
)
@click.option(
    "--commits",
    is_flag=True,
    help="Instead: what the wake-up trigger costs the applications' commits "
    "(pgbench, 16 clients, single-row INSERTs; --rows transactions per run).",
)
@click.option(
    "--horizon",
    is_flag=True,
    help="Instead: --horizon-relays relays while something holds the MVCC horizon "
    "(--holders), writers committing --rate rows/s (over --keys ordering keys) for "
    "--horizon-seconds; latency, claim time, dead rows and table size per "
    "--window-seconds (--payload defaults to 200 here).",
)
@click.option(
    "--scheduled",
    is_flag=True,
    help="Instead: scheduled delivery.  One relay, --rate rows/s due now (--rows-per-commit, "
    "--payload defaults to 200 here) for --scheduled-seconds, three runs: nothing scheduled, "
    "--scheduled-rows waiting (due over --scheduled-days), and the same with --due-rate rows/s "
    "coming due; commit -> delivery latency against nothing scheduled, due -> delivery "
    "lateness, and EXPLAIN (ANALYZE, BUFFERS) of one claim and one move; then the same with "
    "a snapshot held (--no-scheduled-held: not).",
)
@click.option(
    "--scheduled-rows",
    default=1_000_000,
    show_default=True,
    type=click.IntRange(1, 100_000_000),
    help="--scheduled: rows waiting in the scheduled table.",
)
@click.option(
    "--scheduled-days",
    default=30.0,
    show_default=True,
    type=FiniteFloatRange(0, 3650, min_open=True),
    help="--scheduled: the backlog comes due evenly over this many days, from an hour on.",
)
@click.option(
    "--due-rate",
    default=1000.0,
    show_default=True,
    type=FiniteFloatRange(0, 1_000_000, min_open=True),
    help="--scheduled: scheduled rows coming due per second in the third run.",
)
@click.option(
    "--scheduled-seconds",
    default=60.0,
    show_default=True,
    type=FiniteFloatRange(0, DAY, min_open=True),
    help="--scheduled: length of each run.",
)
@click.option(
    "--scheduled-held/--no-scheduled-held",
    default=True,
    show_default=True,
    help="--scheduled: also run the three with a snapshot held (REPEATABLE READ that read "
    "the outbox, as pg_dump).",
)
@click.option(
    "--soak",
    is_flag=True,
    help="Instead: --soak-seconds of steady load (--rate) on a private PostgreSQL and "
    "RabbitMQ node with a fault every twelfth of the run (relay kill -9, broker restart, "
    "PostgreSQL restart, a snapshot held a sixth of the run): latency, throughput, "
    "relay RSS and open files, dead rows per window; exit 1 if a row was lost or "
    "duplicates exceed the bound.",
)
@click.option(
    "--soak-seconds",
    default=3600.0,
    show_default=True,
    type=FiniteFloatRange(0, 7 * DAY, min_open=True),
    help="Length of the soak (given alone, it asks for --soak); windows are a twelfth "
    "of it unless --window-seconds.",
)
@click.option(
    "--holders",
    default=DEFAULT_HOLDERS,
    show_default=True,
    help="--horizon: what holds it, one run each: none (control), snapshot (REPEATABLE "
    "READ that read the outbox, as pg_dump), untouched (REPEATABLE READ, outbox never "
    "read), logical-slot, physical-slot (a hot standby with hot_standby_feedback = on "
    "holding a snapshot; private cluster only), prepared (another application's prepared "
    "transaction).",
)
@click.option(
    "--horizon-relays",
    default=1,
    show_default=True,
    type=click.IntRange(1, 64),
    help="--horizon: relays side by side (claims and CPU per claim over all of them).",
)
@click.option(
    "--keys",
    default=0,
    show_default=True,
    type=click.IntRange(0, 10_000_000),
    help="--horizon: ordering keys the writers' rows share, row i getting key i mod N "
    "as in the ordering runs (0: no key).",
)
@click.option(
    "--table-autovacuum",
    type=click.Choice(["outbox", "server"]),
    default="outbox",
    show_default=True,
    help="--horizon: the outbox table's own autovacuum parameters (as `outbox init` sets "
    "them) or the server's defaults (the table's reset), to measure what they are worth.",
)
@click.option(
    "--find-rate",
    is_flag=True,
    help="--horizon: first a ramp with nothing held, from --rate doubling, two "
    "--window-seconds a step, until the writers fall short or the backlog grows over "
    "the second window by more than 5% of its rows; prints the highest rate sustained "
    "and runs the holders at it (at --rate if none was).",
)
@click.option(
    "--horizon-seconds",
    default=240.0,
    show_default=True,
    type=FiniteFloatRange(0, DAY, min_open=True),
    help="--horizon: length of each run.",
)
@click.option(
    "--window-seconds",
    default=None,
    type=FiniteFloatRange(0, DAY, min_open=True),
    help="--horizon and --soak: figures per window of this length "
    "[default: 60 for --horizon, a twelfth of --soak-seconds for --soak].",
)
@click.option(
    "--rate",
    default=1000.0,
    show_default=True,
    type=FiniteFloatRange(0, 1_000_000, min_open=True),
    help="--horizon, --soak and --scheduled: rows committed per second.",
)
@click.option(
    "--rows-per-commit",
    default=10,
    show_default=True,
    type=click.IntRange(1, 100_000),
    help="--horizon, --soak and --scheduled: rows per application transaction.",
)
@click.option(
    "--fleet",
    is_flag=True,
    help="Instead: many databases on one PostgreSQL cluster (--fleet-databases, each "
    "written at --fleet-rate rows/s): one single-database relay on one of them (the "
    "baseline), one and two `outbox relay --targets FILE` on all, their idle cost "
    "(CPU, sessions per database, RSS), a backlog in one database, a database added "
    "to and removed from the targets while running (--payload defaults to 200 here).",
)
@click.option(
    "--fleet-runs",
    default=",".join(FLEET_RUNS),
    show_default=True,
    help="--fleet: the runs, comma-separated.",
)
@click.option(
    "--fleet-databases",
    default=50,
    show_default=True,
    type=click.IntRange(3, 1000),
    help="--fleet: databases on the cluster.",
)
@click.option(
    "--fleet-rate",
    default=20.0,
    show_default=True,
    type=FiniteFloatRange(0, 10_000, min_open=True),
    help="--fleet: rows committed per second in each written database.",
)
@click.option(
    "--fleet-seconds",
    default=30.0,
    show_default=True,
    type=FiniteFloatRange(0, DAY, min_open=True),
    help="--fleet: measured length of each written run.",
)
@click.option(
    "--fleet-idle-seconds",
    default=60.0,
    show_default=True,
    type=FiniteFloatRange(0, DAY, min_open=True),
    help="--fleet: length of the idle window (once the targets are dormant).",
)
@click.option(
    "--fleet-backlog",
    default=200_000,
    show_default=True,
    type=click.IntRange(1, 100_000_000),
    help="--fleet: rows of the backlog run's backlog.",
)
@click.option(
    "--fleet-dormant-after",
    default=None,
    type=FiniteFloatRange(0, DAY, min_open=True),
    help="--fleet: the fleet relays' --dormant-after [default: theirs].",
)
@click.option(
    "--prefetch",
    default=200,
    show_default=True,
    type=click.IntRange(1, 65535),
    help="Prefetch of both consumers.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@known_errors
def bench(
    dsn: str | None,
    amqp_url: str,
    relays: str,
    batch_sizes: str,
    as_json: bool,
    consume: bool,
    consume_returned: bool,
    commits: bool,
    prefetch: int,
    memory_backlogs: str,
    horizon: bool,
    scheduled: bool,
    scheduled_rows: int,
    scheduled_days: float,
    due_rate: float,
    scheduled_seconds: float,
    scheduled_held: bool,
    soak: bool,
    soak_seconds: float,
    holders: str,
    horizon_relays: int,
    table_autovacuum: str,
    keys: int,
    find_rate: bool,
    horizon_seconds: float,
    window_seconds: float | None,
    rate: float,
    rows_per_commit: int,
    fleet: bool,
    fleet_runs: str,
    fleet_databases: int,
    fleet_rate: float,
    fleet_seconds: float,
    fleet_idle_seconds: float,
    fleet_backlog: int,
    fleet_dormant_after: float | None,
    **options: Any,
) -> None:
    """Measure the relay against a bare pika publisher: msg/s, latency, idle cost
    (with --consume: the consumer's inbox against a bare kombu consumer; with
    --consume-returned: what custody costs it per message; with --commits: the
    applications' commits under the wake-up trigger)."""
    from outbox.bench.harness import BenchOptions
    from outbox.bench.run import render, run_bench

    echo: Callable[[str], None] = (lambda _line: None) if as_json else click.echo

    def given(option: str) -> bool:
        source = click.get_current_context().get_parameter_source(option)
        return source not in (None, click.core.ParameterSource.DEFAULT)

    payload_given = given("payload")
    if fleet:
        from outbox.bench import fleet as bench_fleet

        try:
            runs = bench_fleet.parse_runs(fleet_runs)
        except ValueError as exc:
            raise click.UsageError(f"--fleet-runs: {exc}") from exc
        fleet_report = bench_fleet.run_fleet_bench(
            bench_fleet.FleetOptions(
                amqp_url=urls.parse_amqp_urls(amqp_url)[0].text,
                dsn=dsn,
                databases=fleet_databases,
                rate=fleet_rate,
                seconds=fleet_seconds,
                idle_seconds=fleet_idle_seconds,
                backlog=fleet_backlog,
                payload=options["payload"] if payload_given else 200,
                dormant_after=fleet_dormant_after,
                runs=runs,
            ),
            echo,
        )
        click.echo(
            json.dumps(fleet_report, indent=2) if as_json else bench_fleet.render(fleet_report)
        )
        sys.exit(0 if fleet_report["every_row_arrived"] else int(ExitCode.FAILURE))
    if soak or given("soak_seconds"):
        from outbox.bench import soak as bench_soak

        if dsn:
            raise click.UsageError(
                "--soak restarts PostgreSQL and RabbitMQ: it runs servers of its own; omit --dsn"
            )
        soak_report = bench_soak.run_soak(
            bench_soak.SoakOptions(
                seconds=soak_seconds,
                window_seconds=window_seconds,
                rate=rate,
                rows_per_commit=rows_per_commit,
                payload=options["payload"] if payload_given else 200,
            ),
            echo,
        )
        click.echo(json.dumps(soak_report, indent=2) if as_json else bench_soak.render(soak_report))
        healthy = soak_report["nothing_lost"] and soak_report["duplicates_within_bound"]
        if not healthy:
            click.echo(f"the relays' logs are kept in {soak_report['relay_logs']}", err=True)
        sys.exit(0 if healthy else int(ExitCode.FAILURE))
    if scheduled:
        from outbox.bench import scheduled as bench_scheduled

        scheduled_report = bench_scheduled.run_scheduled_bench(
            bench_scheduled.ScheduledOptions(
                amqp_url=urls.parse_amqp_urls(amqp_url)[0].text,
                dsn=dsn,
                scheduled=scheduled_rows,
                days=scheduled_days,
                rate=rate,
                due_rate=due_rate,
                seconds=scheduled_seconds,
                rows_per_commit=rows_per_commit,
                payload=options["payload"] if payload_given else 200,
                holders=("none", "snapshot") if scheduled_held else ("none",),
            ),
            echo,
        )
        click.echo(
            json.dumps(scheduled_report, indent=2)
            if as_json
            else bench_scheduled.render(scheduled_report)
        )
        sys.exit(0 if scheduled_report["nothing_lost"] else int(ExitCode.FAILURE))
    if horizon:
        from outbox.bench import horizon as bench_horizon

        try:
            holder_kinds = bench_horizon.parse_holders(holders)
        except ValueError as exc:
            raise click.UsageError(f"--holders: {exc}") from exc
        horizon_report = bench_horizon.run_horizon_bench(
            bench_horizon.HorizonOptions(
                amqp_url=urls.parse_amqp_urls(amqp_url)[0].text,
                dsn=dsn,
                holders=holder_kinds,
                seconds=horizon_seconds,
                window_seconds=window_seconds or 60.0,
                rate=rate,
                rows_per_commit=rows_per_commit,
                payload=options["payload"] if payload_given else 200,
                relays=horizon_relays,
                keys=keys,
                find_rate=find_rate,
                autovacuum=table_autovacuum,
            ),
            echo,
        )
        click.echo(
            json.dumps(horizon_report, indent=2, default=str)
            if as_json
            else bench_horizon.render(horizon_report)
        )
        sys.exit(0 if horizon_report["every_row_arrived"] else int(ExitCode.FAILURE))
    if commits:
        from outbox.bench import commits as bench_commits

        commits_report = bench_commits.run_commits_bench(
            bench_commits.CommitsOptions(
                dsn=dsn,
                transactions=options["rows"],
                payload=options["payload"],
                repeats=options["repeats"],
            ),
            echo,
        )
        click.echo(
            json.dumps(commits_report, indent=2)
            if as_json
            else bench_commits.render(commits_report)
        )
        sys.exit(0)
    if consume_returned:
        from outbox.bench import returned as bench_returned
        from outbox.bench.consume import ConsumeBenchOptions

        returned_report = bench_returned.run_returned_bench(
            ConsumeBenchOptions(
                amqp_url=urls.parse_amqp_urls(amqp_url)[0].text,
                dsn=dsn,
                rows=options["rows"],
                payload=options["payload"],
                repeats=options["repeats"],
                prefetch=prefetch,
                window=options["window"],
            ),
            echo,
        )
        click.echo(
            json.dumps(returned_report, indent=2)
            if as_json
            else bench_returned.render(returned_report)
        )
        sys.exit(0 if returned_report["every_message_once"] else int(ExitCode.FAILURE))
    if consume:
        from outbox.bench import consume as bench_consume

        consume_report = bench_consume.run_consume_bench(
            bench_consume.ConsumeBenchOptions(
                amqp_url=urls.parse_amqp_urls(amqp_url)[0].text,
                dsn=dsn,
                rows=options["rows"],
                payload=options["payload"],
                repeats=options["repeats"],
                prefetch=prefetch,
                window=options["window"],
                latency_rate=options["latency_rate"],
                latency_seconds=options["latency_seconds"],
            ),
            echo,
        )
        click.echo(
            json.dumps(consume_report, indent=2)
            if as_json
            else bench_consume.render(consume_report)
        )
        sys.exit(0 if consume_report["every_message_once"] else int(ExitCode.FAILURE))

    def numbers(text: str, option: str, most: int) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(",") if v.strip())
        except ValueError as exc:
            raise click.UsageError(f"{option}: not a list of numbers: {text!r}") from exc
        if not values or min(values) < 1 or max(values) > most:
            raise click.UsageError(f"{option}: not a list of numbers from 1 to {most}: {text!r}")
        return values

    from outbox.bench.memory import parse_backlogs

    try:
        backlogs = parse_backlogs(memory_backlogs)
    except ValueError as exc:
        raise click.UsageError(f"--memory-backlogs: {exc}") from exc
    if not backlogs:
        raise click.UsageError("--memory-backlogs: no backlog given")
    bench_options = BenchOptions(
        # The bare publisher is plain pika: it takes one URL, so all take the first.
        amqp_url=urls.parse_amqp_urls(amqp_url)[0].text,
        dsn=dsn,
        relays=numbers(relays, "--relays", 64),
        batch_sizes=numbers(batch_sizes, "--batch-sizes", int(LIMITS["batch_size"].high)),
        memory_backlogs=backlogs,
        **options,
    )
    report = run_bench(bench_options, echo)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(render(report))
    sys.exit(0 if report["every_row_arrived"] else int(ExitCode.FAILURE))
