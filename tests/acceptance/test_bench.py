"""``outbox bench`` end to end on tiny numbers: structure and delivery, never speed."""

from __future__ import annotations

import json
import shutil

import psycopg
import pytest

from outbox.bench import scheduled as bench_scheduled
from outbox.bench.returned import render as render_returned
from outbox.cli.consume import consume as consume_command
from tests.fixtures.servers import run_cli


def test_bench__json_report_has_every_figure_and_every_row_arrived(
    pg_server: str, amqp_url: str
) -> None:
    result = run_cli(
        "bench",
        "--json",
        "--dsn",
        pg_server,
        "--amqp-url",
        amqp_url,
        "--rows",
        "300",
        "--payload",
        "64",
        "--repeats",
        "1",
        "--relays",
        "1,2",
        "--batch-sizes",
        "50,1000",
        "--latency-rate",
        "100",
        "--latency-seconds",
        "0.3",
        "--idle-seconds",
        "0.5",
        "--burst-writers",
        "3",
        "--burst-rows",
        "50",
        "--burst-pause",
        "0.05",
        "--memory-backlogs",
        "50x1KiB,3x1MiB+1x3MiB",
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["every_row_arrived"] is True
    throughput = report["throughput"]
    assert len(throughput["bare_msg_per_s"]) == len(throughput["relay_msg_per_s"]) == 1
    assert throughput["bare_median"] > 0 and throughput["relay_median"] > 0
    # CPU seconds per 10,000 messages from /proc: the relay, its PostgreSQL backends
    # (this server is local), and the bare publisher's process.
    for figure in ("bare_cpu_s_per_10k", "relay_cpu_s_per_10k", "relay_backend_cpu_s_per_10k"):
        assert throughput[figure] is not None and throughput[figure] >= 0, figure
    assert all(s["cpu_s_per_10k"] is not None for s in report["scaling"])
    assert {(s["relays"], s["batch_size"]) for s in report["scaling"]} == {
        (1, 50),
        (1, 1000),
        (2, 50),
        (2, 1000),
    }
    assert all(s["delivered"] == 300 for s in report["scaling"])
    # Each relay count N against N bare publishers in parallel (a process each), once
    # per round whatever the batch size; the ratio from the medians before rounding.
    for s in report["scaling"]:
        assert len(s["parallel_bare_runs_msg_per_s"]) == 1 and s["parallel_bare_msg_per_s"] > 0
        expected = s["msg_per_s"] / s["parallel_bare_msg_per_s"]
        assert s["ratio_to_parallel_bare"] == pytest.approx(expected, rel=0.02, abs=0.01)
        assert s["ratio_to_bare"] == pytest.approx(
            s["msg_per_s"] / throughput["bare_median"], rel=0.02, abs=0.01
        )
        assert s["parallel_bare_cpu_s_per_10k"] is not None
    by_count = {
        count: {
            tuple(s["parallel_bare_runs_msg_per_s"])
            for s in report["scaling"]
            if s["relays"] == count
        }
        for count in (1, 2)
    }
    assert all(len(runs) == 1 for runs in by_count.values()), by_count
    latency = report["latency"]
    assert latency["delivered"] == latency["sent"] == 30
    assert latency["p50_ms"] <= latency["p95_ms"] <= latency["p99_ms"] <= latency["max_ms"]
    assert latency["committed_per_s"] > 0 and latency["relay_cpu_s_per_10k"] is not None
    # The baseline under the same producers: the relay's loop without two-phase commit.
    baseline = latency["baseline"]
    assert baseline["delivered"] == baseline["sent"] == 30
    assert baseline["p50_ms"] <= baseline["p99_ms"] <= baseline["max_ms"]
    # The bursty load: 3 writers x 2 commits x 50 rows, per relay count; no fault is
    # injected, so no duplicate and no rollback.
    assert [(b["relays"], b["rows"]) for b in report["bursts"]] == [(1, 300), (2, 300)]
    assert all(b["duplicates"] == 0 and b["rolled_back"] == 0 for b in report["bursts"])
    assert all(b["delivered_min"] == 300 for b in report["bursts"])
    assert set(report["idle"]) == {"seconds", "cpu_percent_of_a_core", "db_transactions_per_s"}
    # Per-key ordering: the same 300 rows unordered and over 1,000 keys, a quarter of
    # them on one hot key; every row arrived.
    shapes = {s["shape"]: s for s in report["ordering"]["shapes"]}
    assert [(n, s["rows"]) for n, s in shapes.items()] == [
        ("unordered", 300),
        ("1000_keys", 300),
        ("one_hot_key", 75),
    ]
    assert all(s["delivered_min"] == s["rows"] and s["msg_per_s"] > 0 for s in shapes.values())
    assert shapes["unordered"]["ratio_to_unordered"] == 1.0
    assert report["ordering"]["bare_window_1"]["rows"] == 75
    # Peak RSS of one relay draining each backlog: figures, not bounds.
    memory = report["memory"]
    assert [(m["backlog"], m["rows"]) for m in memory] == [
        ("50 x 1 KiB", 50),
        ("3 x 1 MiB + 1 x 3 MiB", 4),
    ]
    assert all(m["exactly_once"] and m["peak_rss_bytes"] > 0 for m in memory)


def test_bench__only_the_relays_against_as_many_bare_publishers_in_parallel(
    pg_server: str, amqp_url: str
) -> None:
    """What issue 33's target needs and nothing else: no bursts, ordering, memory,
    latency or idle run; the grid's row for 2 relays beside 2 bare publishers."""
    out = run_cli(
        "bench",
        "--dsn",
        pg_server,
        "--amqp-url",
        amqp_url,
        "--no-bursts",
        "--no-memory",
        "--no-ordering",
        "--no-latency",
        "--relays",
        "2",
        "--batch-sizes",
        "1000",
        "--rows",
        "200",
        "--repeats",
        "1",
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    header = "| relays | batch | msg/s | N bare msg/s | ratio to N bare | ratio to 1 bare |"
    assert header in out.stdout
    [row] = [line for line in out.stdout.splitlines() if line.startswith("| 2 | 1000 | ")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[4]) > 0 and float(cells[5]) > 0
    assert "2 bare publisher(s) in parallel run 1:" in out.stdout
    assert "latency at" not in out.stdout and "idle relay" not in out.stdout
    assert "every row arrived exactly once" in out.stdout


def test_bench_consume__reports_effects_per_second_against_a_bare_consumer(
    pg_server: str, amqp_url: str
) -> None:
    result = run_cli(
        "bench",
        "--consume",
        "--json",
        "--dsn",
        pg_server,
        "--amqp-url",
        amqp_url,
        "--rows",
        "300",
        "--payload",
        "64",
        "--repeats",
        "2",
        "--latency-rate",
        "100",
        "--latency-seconds",
        "0.3",
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["every_message_once"] is True
    consume = report["consume"]
    assert (
        len(consume["bare_msg_per_s"])
        == len(consume["handwritten_effects_per_s"])
        == len(consume["inbox_effects_per_s"])
        == len(consume["async_effects_per_s"])
        == 2
    )
    assert consume["bare_median"] > 0 and consume["inbox_median"] > 0
    assert consume["handwritten_median"] > 0 and consume["async_median"] > 0
    # From the medians before they were rounded to whole msg/s.
    expected = consume["inbox_median"] / consume["bare_median"]
    assert consume["ratio"] == pytest.approx(expected, rel=0.02, abs=0.01)
    ratio_to_handwritten = consume["inbox_median"] / consume["handwritten_median"]
    assert abs(consume["ratio_to_handwritten"] - ratio_to_handwritten) < 0.01
    # The same handler as an async def, in the same run.
    async_ratio = consume["async_median"] / consume["bare_median"]
    assert consume["async_ratio"] == pytest.approx(async_ratio, rel=0.02, abs=0.01)
    # CPU per 10,000 messages of each consumer's process and (local server) its backend:
    # None when 300 messages went by between two of the bench's polls.
    for kind in ("inbox", "async"):
        for figure in (f"{kind}_cpu_s_per_10k", f"{kind}_backend_cpu_s_per_10k"):
            assert consume[figure] is None or consume[figure] >= 0, figure
    # Publish -> committed effect, every message's commit seen.
    latency = report["latency"]
    assert latency["committed"] == latency["sent"] == 30
    assert latency["p50_ms"] <= latency["p95_ms"] <= latency["p99_ms"] <= latency["max_ms"]
    # The bench measures the consumer at its defaults: the same prefetch as `outbox consume`.
    consume_default = next(p.default for p in consume_command.params if p.name == "prefetch")
    assert report["prefetch"] == consume_default and report["rows"] == 300
    text = run_cli(
        "bench",
        "--consume",
        "--dsn",
        pg_server,
        "--amqp-url",
        amqp_url,
        "--rows",
        "50",
        "--repeats",
        "1",
        "--latency-seconds",
        "0.2",
        timeout=180,
    )
    assert text.returncode == 0 and "every message had exactly one effect" in text.stdout
    assert "hand-written kombu + psycopg" in text.stdout and "committed effect" in text.stdout
    assert "the same handler `async def`" in text.stdout


def test_bench_consume_returned__reports_custody_against_redelivered_and_first_deliveries(
    pg_server: str, amqp_url: str
) -> None:
    result = run_cli(
        "bench",
        "--consume-returned",
        "--json",
        "--dsn",
        pg_server,
        "--amqp-url",
        amqp_url,
        "--rows",
        "50",
        "--payload",
        "64",
        "--repeats",
        "1",
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    # Every case applied each message once, and took the path it names: the
    # consumer's own count of messages taken into custody.
    assert report["every_message_once"] is True
    cases = report["cases"]
    assert [cases[c]["traced"]["custody_taken"] for c in ("custody", "redelivered", "first")] == [
        50,
        0,
        0,
    ]
    for case in cases.values():
        assert len(case["effects_per_s"]) == 1 and case["median"] > 0
        assert case["traced"]["statements_per_message"] > 0
        assert case["traced"]["round_trips_per_message"] > 0
    expected = cases["custody"]["median"] / cases["redelivered"]["median"]
    assert report["custody_to_redelivered"] == pytest.approx(expected, rel=0.02, abs=0.01)
    text = render_returned(report)
    assert "| returned once; quorum, x-delivery-limit: custody |" in text
    assert "every message had exactly one effect, custody left empty" in text


def test_bench_memory_only__prints_the_peak_rss_of_each_backlog(
    pg_server: str, amqp_url: str
) -> None:
    common = ("bench", "--memory-only", "--dsn", pg_server, "--amqp-url", amqp_url)
    text = run_cli(*common, "--memory-backlogs", "20x1KiB,2x2MiB+1x5MiB", timeout=180)
    assert text.returncode == 0, text.stderr
    assert "| 20 x 1 KiB | 20 KiB |" in text.stdout
    assert "| 2 x 2 MiB + 1 x 5 MiB | 9 MiB |" in text.stdout
    assert "every row arrived exactly once" in text.stdout
    usage = run_cli(*common, "--memory-backlogs", "3 rows of 8MiB")
    assert usage.returncode == 2 and "1000x8MiB+1x64MiB" in usage.stderr


def test_bench_commits__every_trigger_and_the_trigger_put_back(
    pg_server: str, amqp_url: str
) -> None:
    out = run_cli(
        "bench",
        "--commits",
        "--dsn",
        pg_server,
        "--rows",
        "160",
        "--repeats",
        "1",
        "--json",
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    cells = {(c["flush_delay_us"], c["trigger"]) for c in report["cells"]}
    triggers = {"none", "schema 4", "schema 5, relays busy", "schema 5, a relay waiting"}
    assert {t for _, t in cells} == triggers
    assert all(c["commits_per_s"] > 0 and c["latency_ms"] > 0 for c in report["cells"])
    assert report["trigger_restored"] is True
    with psycopg.connect(pg_server) as conn:  # the bench's tables are gone
        left = conn.execute("SELECT count(*) FROM pg_tables WHERE tablename LIKE 'outbox_bench_%'")
        assert left.fetchone() == (0,)


def test_bench_horizon__per_window_figures_for_each_holder_and_what_status_names(
    pg_server: str, amqp_url: str
) -> None:
    common = ("bench", "--horizon", "--dsn", pg_server, "--amqp-url", amqp_url)
    out = run_cli(
        *common,
        "--holders",
        "none,snapshot,logical-slot,physical-slot",
        "--horizon-seconds",
        "2",
        "--window-seconds",
        "1",
        "--rate",
        "300",
        "--horizon-relays",
        "2",
        "--keys",
        "10",
        "--json",
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["every_row_arrived"] is True
    assert (report["rate"], report["rows_per_commit"], report["payload_bytes"]) == (300, 10, 200)
    assert (report["relays"], report["keys"], report["ramp"]) == (2, 10, None)
    runs = {r["holder"]: r for r in report["runs"]}
    # The shared test server has wal_level = replica: no logical slot there.
    assert "wal_level = logical" in runs["logical-slot"]["skipped"]
    # Nor a standby: it would be a base backup of the whole server.
    assert "needs the private cluster" in runs["physical-slot"]["skipped"]
    for kind in ("none", "snapshot"):
        run = runs[kind]
        assert [w["window"] for w in run["windows"]] == [0, 1], kind
        assert run["sent"] == run["delivered"] > 0 and run["duplicates"] == 0
        assert all(w["claims"] > 0 and w["claim_mean_ms"] > 0 for w in run["windows"]), kind
        assert all(w["p50_ms"] <= w["p99_ms"] for w in run["windows"]), kind
        assert run["table_bytes_end"] > 0
    # What `outbox status` names while each holds: the held snapshot by its session.
    assert runs["none"]["status_names"] == "nothing"
    assert runs["snapshot"]["status_names"] == "session 'outbox-bench-snapshot' idle in transaction"
    assert runs["snapshot"]["dead_rows_end"] > 0 and runs["snapshot"]["horizon_age_xids_end"] > 0
    with psycopg.connect(pg_server) as conn:  # the bench's tables are gone
        left = conn.execute(
            "SELECT count(*) FROM pg_tables WHERE tablename LIKE 'outbox_horizon_%'"
        )
        assert left.fetchone() == (0,)
    usage = run_cli(*common, "--holders", "snapshot,vacuum")
    assert usage.returncode == 2 and "none, snapshot, untouched" in usage.stderr


def test_bench_scheduled__latency_lateness_and_calls_with_and_without_a_backlog(
    pg_server: str, amqp_url: str
) -> None:
    result = run_cli(
        "bench",
        "--scheduled",
        "--dsn",
        pg_server,
        "--amqp-url",
        amqp_url,
        "--scheduled-rows",
        "2000",
        "--scheduled-seconds",
        "2",
        "--rate",
        "200",
        "--due-rate",
        "150",
        "--json",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["nothing_lost"] is True
    assert (report["scheduled"], report["rate"], report["due_rate"]) == (2000, 200, 150)
    runs = {(r["holder"], r["shape"]): r for r in report["runs"]}
    assert set(runs) == {(h, s) for h in ("none", "snapshot") for s in ("none", "backlog", "due")}
    for (holder, shape), run in runs.items():
        assert run["skipped"] is None and run["duplicates"] == 0
        immediate = run["immediate"]
        assert immediate["sent"] == immediate["delivered"] > 0, (holder, shape)
        assert immediate["p50_ms"] <= immediate["p99_ms"] <= immediate["max_ms"]
        # The backlog waits, whole: none of it was due during the run.
        assert run["scheduled"] == run["scheduled_left"] == (0 if shape == "none" else 2000)
        if shape == "due":  # 150 rows/s for 2 s, each delivered once, none early
            assert run["due"]["sent"] == run["due"]["delivered"] == 300
            assert 0 < run["due"]["p50_ms"] <= run["due"]["p99_ms"] <= run["due"]["max_ms"]
        else:
            assert run["due"] is None
        # Ratios to the control only for the backlog, which ran beside it.
        beside = shape in ("none", "backlog")
        assert ("p50_to_control" in run) == ("p99_to_control" in run) == beside, shape
        calls = run["explain"]
        for kind in ("claim_first", "claim", "move", "sweep"):
            assert calls[kind]["buffers"] > 0 and calls[kind]["ms"] > 0, (holder, shape, kind)
        assert calls["move"]["rows"] == calls["sweep"]["rows"] == 200
        # The shared test server does not load pg_stat_statements.
        assert run["relay_calls"] is None or set(run["relay_calls"]) == {"claim", "move"}
    assert runs[("none", "none")]["p50_to_control"] == 1.0
    with psycopg.connect(pg_server) as conn:  # the bench's tables are gone
        left = conn.execute("SELECT count(*) FROM pg_tables WHERE tablename LIKE 'outbox_sched_%'")
        assert left.fetchone() == (0,)
    text = bench_scheduled.render(report)
    assert "| snapshot | due |" in text and "EXPLAIN (ANALYZE, BUFFERS)" in text
    assert "nothing lost: every row due now and every row come due arrived exactly once" in text


def test_bench_horizon__a_standby_holds_it_through_a_physical_slot(
    pg_server: str, amqp_url: str
) -> None:
    """On the bench's private cluster: a hot standby with hot_standby_feedback holds
    the horizon through its slot, and `outbox status` names the slot; two relays
    claiming keyed rows."""
    out = run_cli(
        "bench",
        "--horizon",
        "--amqp-url",
        amqp_url,
        "--holders",
        "physical-slot",
        "--horizon-seconds",
        "2",
        "--window-seconds",
        "1",
        "--rate",
        "300",
        "--horizon-relays",
        "2",
        "--keys",
        "10",
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    header = next(line for line in lines if line.startswith("outbox bench --horizon:"))
    assert "10 ordering keys" in header and "2 relays" in header
    held = next(line for line in lines if line.startswith("| physical-slot | ") and " → " in line)
    assert "| replication slot 'outbox_bench_" in held
    assert "every row arrived exactly once" in out.stdout


def test_bench_horizon__find_rate_ramps_until_a_step_falls_short_and_runs_the_holders_at_it(
    pg_server: str, amqp_url: str
) -> None:
    """The ramp's structure, whatever this machine's speed: rates doubling from
    --rate, every step sustained but the last, the holders at the last sustained."""
    out = run_cli(
        "bench",
        "--horizon",
        "--dsn",
        pg_server,
        "--amqp-url",
        amqp_url,
        "--find-rate",
        "--rate",
        "2000",
        "--holders",
        "none",
        "--horizon-seconds",
        "1",
        "--window-seconds",
        "0.5",
        "--json",
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    steps = report["ramp"]["steps"]
    assert [s["rate"] for s in steps] == [2000 * 2**n for n in range(len(steps))]
    assert all(s["sustained"] and s["fell_short"] is None for s in steps[:-1])
    last = steps[-1]
    assert not last["sustained"] and last["fell_short"] in ("writers", "relays")
    assert last["why_not"].startswith(("the writers committed", "the backlog grew"))
    found = steps[-2]["rate"] if len(steps) > 1 else None
    assert report["ramp"]["found"] == found
    assert report["rate"] == (found or 2000)
    assert report["runs"][0]["rate"] == report["rate"]


@pytest.mark.slow
def test_bench_soak__faults_in_turn_nothing_lost_duplicates_within_the_bound() -> None:
    """A 30 s soak: every fault once (relay kill -9, broker restart, PostgreSQL
    restart, a held snapshot), per-window figures, and the end-of-run checks."""
    out = run_cli("bench", "--soak-seconds", "30", "--rate", "200", "--json", timeout=600)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    # The soak keeps its relays' logs for whoever ran it; this test reads none of them.
    shutil.rmtree(report["relay_logs"], ignore_errors=True)
    assert [f["fault"] for f in report["faults"]] == [
        "relay-kill",
        "broker-restart",
        "postgres-restart",
        "snapshot",
    ]
    assert report["relays_killed"] == 1 and len(report["windows"]) == 12
    assert report["nothing_lost"] and report["lost"] == report["rows_left"] == 0
    assert report["committed"] > 0 and report["prepared_left"] == 0
    assert report["duplicates"] <= report["duplicate_bound"] == 3 * 2 * 1000
    for window in report["windows"]:
        assert window["rss_bytes"] is None or window["rss_bytes"] > 0
        assert window["open_files"] is None or window["open_files"] > 0
    assert any(w["dead_rows"] for w in report["windows"])


def test_bench_soak__refuses_a_server_it_would_restart(pg_server: str) -> None:
    usage = run_cli("bench", "--soak", "--soak-seconds", "10", "--dsn", pg_server)
    assert usage.returncode == 2 and "omit --dsn" in usage.stderr


def test_bench_retries__reports_each_retry_queue_kind(
    amqp_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m outbox.bench.retries``: a row per retry queue type in each table,
    (structure only: the figures are the broker's)."""
    from outbox.bench import retries

    assert retries.main(["--amqp-url", amqp_url, "--long", "1", "--short", "0.2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for table in ("head_of_line", "into_full_queue"):
        assert [row["queue_type"] for row in report[table]] == ["classic", "quorum"]
    assert all(row["waited_s"] is not None for row in report["head_of_line"])
    assert {row["fate"] for row in report["into_full_queue"]} <= {
        "arrived",
        "dropped",
        "still waiting",
    }


def test_bench_drain__reports_both_tables_and_their_ratio(
    amqp_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m outbox.bench.drain`` on tiny numbers: a run per table, the dead
    rows really dead behind the held snapshot (structure only, never speed)."""
    from outbox.bench import drain

    argv = ["--amqp-url", amqp_url, "--dead", "5000", "--rows", "300", "--repeats", "1"]
    assert drain.main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["fresh_msg_per_s"]) == len(report["behind_msg_per_s"]) == 1
    assert report["dead_tuples_before_draining"] >= 5000
    assert report["ratio"] > 0
