"""The real ``outbox`` command, run as users run it (subprocesses)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import time

import psycopg

from outbox.config import Settings
from outbox.db import migrate
from outbox.db.devcluster import free_port
from tests.fixtures.docs import assert_output_as_documented, fenced_blocks
from tests.fixtures.servers import Topology, insert_numbered_rows, run_cli, settings_env

LOCAL_PG_WITHOUT_2PC = os.environ.get(
    "OUTBOX_TEST_DSN_NO_2PC", "postgresql://postgres@127.0.0.1:5432/postgres"
)


def assert_one_clear_error(
    result: subprocess.CompletedProcess[str], code: int, *words: str
) -> None:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    for word in words:
        assert word in result.stderr, result.stderr


def test_init__twice_is_idempotent(empty_dsn: str) -> None:
    first = run_cli("init", "--dsn", empty_dsn)
    second = run_cli("init", "--dsn", empty_dsn)
    latest = migrate.LATEST_VERSION
    assert first.returncode == 0, first.stderr
    assert f"migrated from nothing to {latest}" in first.stdout
    assert second.returncode == 0 and f"up to date (version {latest})" in second.stdout


def test_init__concurrent_runs_apply_the_schema_once(empty_dsn: str) -> None:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: run_cli("init", "--dsn", empty_dsn), range(4)))
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    assert sum("migrated from nothing" in r.stdout for r in results) == 1
    with psycopg.connect(empty_dsn) as conn:
        applied = conn.execute("SELECT count(*) FROM outbox_schema_version").fetchone()
    assert applied == (migrate.LATEST_VERSION,), "each migration applied once"


def test_init__print_sql_applies_cleanly_with_psql_semantics(empty_dsn: str) -> None:
    result = run_cli("init", "--print-sql", "--table", "shop_outbox")
    assert result.returncode == 0
    # psql sends statement by statement: CREATE INDEX CONCURRENTLY runs outside the
    # transactions the script opens (one per migration).
    applied = subprocess.run(
        ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", empty_dsn, "-f", "-"],
        input=result.stdout,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert applied.returncode == 0, applied.stderr
    after = run_cli("init", "--dsn", empty_dsn, "--table", "shop_outbox")
    assert "up to date" in after.stdout, after.stderr


def test_init__print_sql_records_no_version_whose_migration_failed(empty_dsn: str) -> None:
    # psql without ON_ERROR_STOP goes on after an error: a migration's transaction
    # stopped by its lock timeout was rolled back, its index builds failed, and the
    # version row after them still said 3 (a relay of 0.3 then started on a schema
    # without ordering_key).
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        migrate.migrate(conn, "outbox", target=2)  # type: ignore[arg-type]
    script = run_cli("init", "--print-sql").stdout

    def psql() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["psql", "-X", "-q", "-d", empty_dsn, "-f", "-"],
            input=script,
            capture_output=True,
            text=True,
            timeout=60,
        )

    with psycopg.connect(empty_dsn) as holder:
        holder.execute("SELECT * FROM outbox FOR UPDATE")  # a long transaction
        stopped = psql()
        assert "lock timeout" in stopped.stderr, stopped.stderr
        assert migrate.current_version(holder, "outbox") == 2, stopped.stderr  # type: ignore[arg-type]
    applied = psql()
    assert "ERROR" not in applied.stderr, applied.stderr
    with psycopg.connect(empty_dsn) as conn:
        assert migrate.current_version(conn, "outbox") == migrate.LATEST_VERSION  # type: ignore[arg-type]
        valid = conn.execute("SELECT bool_and(indisvalid) FROM pg_index").fetchone()
    assert valid == (True,)


def test_plain_sql_insert_from_the_contract_works(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload) "
            "VALUES ('orders', 'order.created', '{\"id\": 1}')"
        )
        row = conn.execute("SELECT payload, message_id IS NOT NULL FROM outbox").fetchone()
    assert row == (b'{"id": 1}', True)


def test_relay__drain_moves_everything_and_exits_zero(
    settings: Settings, topology: Topology
) -> None:
    insert_numbered_rows(settings.dsn, topology.exchange, 500)
    result = run_cli("relay", "--drain", env=settings_env(settings))
    assert result.returncode == 0, result.stderr
    assert "500 published" in result.stderr
    bodies = sorted(int(body) for _, _, body in topology.messages())
    assert bodies == list(range(1, 501))


def test_relay__sigterm_stops_an_idle_relay_cleanly(settings: Settings) -> None:
    script = os.path.join(os.path.dirname(os.sys.executable), "outbox")  # type: ignore[attr-defined]
    proc = subprocess.Popen(
        [script, "relay"],
        env=settings_env(settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 20
    with psycopg.connect(settings.dsn) as conn:
        while time.monotonic() < deadline:
            if conn.execute("SELECT count(*) FROM outbox_relays").fetchone() == (1,):
                break
            time.sleep(0.1)
        else:
            proc.kill()
            raise AssertionError(proc.communicate())
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=20)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    with psycopg.connect(settings.dsn) as conn:
        assert conn.execute("SELECT count(*) FROM outbox_relays").fetchone() == (0,)


def test_relay__prepared_transactions_disabled_says_what_to_set(settings: Settings) -> None:
    env = settings_env(settings)
    env["OUTBOX_DSN"] = LOCAL_PG_WITHOUT_2PC
    result = run_cli("relay", "--drain", env=env)
    assert_one_clear_error(result, 4, "max_prepared_transactions")


def test_relay__schema_missing_says_run_init(empty_dsn: str, settings: Settings) -> None:
    env = settings_env(settings)
    env["OUTBOX_DSN"] = empty_dsn
    result = run_cli("relay", "--drain", env=env)
    assert_one_clear_error(result, 4, "outbox init")


def test_relay__unreachable_database_exits_3(settings: Settings) -> None:
    env = settings_env(settings)
    env["OUTBOX_DSN"] = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    result = run_cli("relay", "--drain", env=env)
    assert_one_clear_error(result, 3, "cannot connect to PostgreSQL", "OUTBOX_DSN")


def test_relay__unreachable_broker_exits_3(settings: Settings) -> None:
    env = settings_env(settings)
    env["OUTBOX_AMQP_URL"] = f"amqp://guest:guest@127.0.0.1:{free_port()}/%2F"
    result = run_cli("relay", "--drain", env=env)
    assert_one_clear_error(result, 3, "cannot connect to RabbitMQ", "OUTBOX_AMQP_URL")


def test_relay__bad_broker_credentials_exit_3(settings: Settings) -> None:
    env = settings_env(settings)
    env["OUTBOX_AMQP_URL"] = "amqp://guest:wrong@127.0.0.1:5672/%2F"
    result = run_cli("relay", "--drain", env=env)
    assert_one_clear_error(result, 3, "cannot connect to RabbitMQ")


def test_status__json_reports_backlog_and_relays(settings: Settings, topology: Topology) -> None:
    with psycopg.connect(settings.dsn) as conn:
        conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload) "
            "VALUES (%s, 'k', 'x'), (%s, 'k', 'y')",
            [topology.exchange, topology.exchange],
        )
    result = run_cli("status", "--json", env=settings_env(settings))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["backlog_rows"] == 2
    assert report["prepared_batches"] == []
    assert report["live_relays"] == 0
    assert report["attention"] == []


def test_resolve__dry_run_with_nothing_in_doubt(settings: Settings) -> None:
    result = run_cli("resolve", "--dry-run", "--json", env=settings_env(settings))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["batches"] == []


def test_usage_error_exits_2() -> None:
    result = run_cli("relay", "--batch-size", "zero")
    assert result.returncode == 2
    bad_table = run_cli("status", "--table", "Bad-Name")
    assert bad_table.returncode == 2 and "table name" in bad_table.stderr


def test_demo__runs_end_to_end_and_prints_what_the_quick_start_shows(amqp_url: str) -> None:
    """``outbox demo`` as docs/tutorial/quickstart.md runs it (on the test broker), and
    its output line by line as the page shows it (numbers and ids aside)."""
    result = run_cli("demo", "--amqp-url", amqp_url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1000/1000 expected, 0 missing, 0 duplicates, 0 unexpected" in result.stdout
    assert "OK: every committed row arrived exactly once" in result.stdout
    blocks = fenced_blocks("tutorial/quickstart.md")
    assert "outbox demo " in blocks[0][1]
    assert_output_as_documented(result.stdout, next(t for lang, t in blocks if lang == "text"))


def test_relay__three_processes_drain_one_table_exactly_once(
    settings: Settings, topology: Topology
) -> None:
    total = 6000
    insert_numbered_rows(settings.dsn, topology.exchange, total)
    script = os.path.join(os.path.dirname(os.sys.executable), "outbox")  # type: ignore[attr-defined]
    procs = [
        subprocess.Popen(
            [script, "relay", "--drain"],
            env=settings_env(settings),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    bodies = sorted(int(body) for _, _, body in topology.messages())
    assert bodies == list(range(1, total + 1))  # every row once: none lost, none twice
    with psycopg.connect(settings.dsn) as conn:
        assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)
        assert conn.execute(
            "SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()"
        ).fetchone() == (0,)
