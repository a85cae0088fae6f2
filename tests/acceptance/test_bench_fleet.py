"""``outbox bench --fleet`` end to end on tiny numbers: every run, every figure, no
row lost or duplicated; never speed."""

from __future__ import annotations

import json

from tests.fixtures.servers import run_cli


def test_bench_fleet__every_run_reports_its_figures_and_every_row_arrives_once(
    pg_server: str, amqp_url: str
) -> None:
    result = run_cli(
        "bench",
        "--fleet",
        "--json",
        "--dsn",
        pg_server,
        "--amqp-url",
        amqp_url,
        "--fleet-databases",
        "3",
        "--fleet-rate",
        "10",
        "--fleet-seconds",
        "2",
        "--fleet-idle-seconds",
        "1",
        "--fleet-backlog",
        "300",
        "--fleet-dormant-after",
        "1",
        timeout=400,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["every_row_arrived"] is True
    assert report["lost"] == 0 and report["duplicates"] == 0
    names = set(report["baseline"]["per_database"])
    assert len(names) == 1
    for run in ("baseline", "one", "two"):
        figures = report[run]
        assert figures["sent"] == figures["delivered"] > 0, run
        assert figures["p50_ms"] <= figures["p99_ms"] <= figures["max_ms"], run
        assert figures["committed_per_s_per_database"] > 0, run
        assert 0 <= figures["machine_busy_percent"] <= 100, run
    for run in ("one", "two"):
        assert len(report[run]["per_database"]) == 3
        assert report[run]["p99_ratio_to_baseline"] > 0
        assert len(report[run]["relay_memory"]) == report[run]["relays"]
        assert len(report[run]["sessions_per_relay"]) == report[run]["relays"]
        assert all(n >= 3 for n in report[run]["sessions_per_relay"])  # a session each at least
    assert report["baseline"]["relay"]["rss_mib"] > 0
    assert report["baseline"]["relay"]["sessions"] >= 1
    # Idle: two fleet relays, dormant, hold sessions in every database; a row in
    # each wakes its database.
    idle = report["idle"]
    assert idle["relays"] == 2 and len(idle["cpu_percent_of_a_core"]) == 2
    assert idle["sessions_total"] >= 2 * 3
    assert idle["sessions_per_database_per_relay_max"] >= 1
    assert idle["single_database_relays_rss_mib"] > 0
    assert idle["wake_up"]["sent"] == idle["wake_up"]["delivered"] == 3
    # The backlog: drained once by a dedicated relay, once by the fleet meanwhile
    # the other two databases were written.
    backlog = report["backlog"]
    assert backlog["dedicated"]["delivered"] == backlog["fleet"]["delivered"] == 300
    assert backlog["drain_ratio"] > 0 and backlog["others_during_drain"]["sent"] >= 0
    # A database added while running delivers; the others kept delivering while one
    # was removed.
    change = report["change"]
    assert change["added_first_row_s"] is not None
    assert change["others"] == 1 and change["others_max_gap_s"] > 0
    # The text report says the same.
    text = run_cli(
        "bench",
        "--fleet",
        "--dsn",
        pg_server,
        "--amqp-url",
        amqp_url,
        "--fleet-runs",
        "baseline",
        "--fleet-databases",
        "3",
        "--fleet-seconds",
        "1",
        timeout=120,
    )
    assert text.returncode == 0, text.stderr
    assert "| baseline: 1 database, `outbox relay` |" in text.stdout
    assert "| relay sessions | machine busy |" in text.stdout
    assert "every row arrived exactly once" in text.stdout


def test_bench_fleet__unknown_run_is_a_usage_error() -> None:
    result = run_cli("bench", "--fleet", "--fleet-runs", "one,nap")
    assert result.returncode == 2
    assert "--fleet-runs" in result.stderr and "nap" in result.stderr
