"""``outbox relay --targets``: one process relays several databases, targets come and
go while it runs, a target that refuses is reported and never stops the others."""

from __future__ import annotations

import collections
import signal
import time
import uuid
from collections.abc import Callable

import psycopg

from outbox.db import migrate
from outbox.db.devcluster import free_port
from tests.acceptance.test_operations_cli import http_get
from tests.fixtures.faults import (
    RelayProcess,
    arrived,
    insert_rows,
    prepared_left,
    relay_sessions,
    rows_left,
    wait_for,
)
from tests.fixtures.servers import Topology
from tests.integration.fleet.conftest import NewDatabase, TargetsFile

Run = Callable[..., RelayProcess]


def database_of(dsn: str) -> str:
    return str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])


def delivered(topology: Topology, got: collections.Counter[str], ids: set[str]) -> bool:
    got.update(arrived(topology))
    return ids <= set(got)


def stop(relay: RelayProcess) -> None:
    relay.process.send_signal(signal.SIGTERM)
    assert relay.wait() == 0, relay.output()


def test_fleet__relays_every_database_of_the_file_and_stops_cleanly(
    new_database: NewDatabase, targets_file: TargetsFile, run_fleet: Run, topology: Topology
) -> None:
    dsns = [new_database() for _ in range(3)]
    targets_file.write(*dsns)
    ids = {i for dsn in dsns for i in insert_rows(dsn, topology.exchange, 30, tag=dsn[-6:])}
    relay = run_fleet(targets_file.path)
    got: collections.Counter[str] = collections.Counter()
    wait_for(lambda: delivered(topology, got, ids), 30, "the rows of all three databases")
    more = {i for dsn in dsns for i in insert_rows(dsn, topology.exchange, 5)}
    wait_for(lambda: delivered(topology, got, ids | more), 10, "rows committed while running")
    stop(relay)
    got.update(arrived(topology))
    assert set(got) == ids | more and max(got.values()) == 1  # nothing lost, no duplicate
    for dsn in dsns:
        assert prepared_left(dsn) == [] and rows_left(dsn) == 0
        assert relay_sessions(dsn) == 0  # unregistered, closed
    output = relay.log()
    for dsn in dsns:
        assert f"database={database_of(dsn)}" in output
    # Every event of a target's relay names its database.
    relay_events = [line for line in output.splitlines() if " outbox.relay" in line]
    assert relay_events and all(" database=" in line for line in relay_events), relay_events


def test_fleet__a_database_added_flows_within_10s_and_one_removed_stops_alone(
    new_database: NewDatabase, targets_file: TargetsFile, run_fleet: Run, topology: Topology
) -> None:
    first, second, third = (new_database() for _ in range(3))
    targets_file.write(first, second)
    relay = run_fleet(targets_file.path)
    got: collections.Counter[str] = collections.Counter()
    ids = set(insert_rows(first, topology.exchange, 3)) | set(
        insert_rows(second, topology.exchange, 3)
    )
    wait_for(lambda: delivered(topology, got, ids), 30, "the first two databases")

    added_at = time.monotonic()
    targets_file.write(first, second, third)
    new = set(insert_rows(third, topology.exchange, 5))
    wait_for(lambda: delivered(topology, got, new), 10, "the added database's rows")
    assert time.monotonic() - added_at < 10

    targets_file.write(first, third)  # the second is removed
    wait_for(lambda: relay_sessions(second) == 0, 15, "the removed target's sessions to end")
    assert "fleet.target_removed" in relay.log()
    left = set(insert_rows(second, topology.exchange, 2))
    still = set(insert_rows(first, topology.exchange, 2)) | set(
        insert_rows(third, topology.exchange, 2)
    )
    wait_for(lambda: delivered(topology, got, still), 10, "the others, still served")
    time.sleep(1.0)
    got.update(arrived(topology))
    assert not left & set(got) and rows_left(second) == 2  # the removed one is not served
    assert relay.process.poll() is None
    stop(relay)


def test_fleet__refusing_targets_are_reported_retried_and_never_stop_the_others(
    new_database: NewDatabase,
    targets_file: TargetsFile,
    run_fleet: Run,
    topology: Topology,
    pg_server: str,
) -> None:
    good = new_database()
    no_table = new_database(schema=False)
    missing = psycopg.conninfo.make_conninfo(pg_server, dbname="f_does_not_exist")
    # The machine's own PostgreSQL has prepared transactions disabled.
    disabled = "postgresql://postgres@127.0.0.1:5432/postgres?connect_timeout=2"
    targets_file.write(good, no_table, missing, disabled)
    relay = run_fleet(targets_file.path)
    ids = set(insert_rows(good, topology.exchange, 10))
    got: collections.Counter[str] = collections.Counter()
    wait_for(lambda: delivered(topology, got, ids), 30, "the good database's rows")

    def reported(database: str) -> bool:
        return any(
            "fleet.target_failed" in line and f"database={database} " in line and "hint=" in line
            for line in relay.log().splitlines()
        )

    wait_for(lambda: reported(database_of(no_table)), 10, "the database without the table")
    wait_for(lambda: reported("f_does_not_exist"), 10, "the database that does not exist")
    wait_for(lambda: reported("127.0.0.1:5432/postgres") or reported("postgres"), 10, "5432")

    with psycopg.connect(no_table, autocommit=True) as conn:
        migrate.migrate(conn, "outbox")  # type: ignore[arg-type]
    fixed = set(insert_rows(no_table, topology.exchange, 4))
    wait_for(lambda: delivered(topology, got, fixed), 30, "the fixed database's rows")
    assert relay.process.poll() is None
    stop(relay)


def test_fleet__discovery_finds_a_database_created_with_the_table_within_10s(
    new_database: NewDatabase, run_fleet: Run, topology: Topology, pg_server: str
) -> None:
    prefix = f"fd{uuid.uuid4().hex[:6]}"
    first = new_database(name=f"{prefix}_a")
    new_database(name=f"{prefix}_empty", schema=False)  # no table: not served
    relay = run_fleet(
        "", OUTBOX_DISCOVER=pg_server, OUTBOX_DATABASES=f"{prefix}_*", OUTBOX_TARGETS=""
    )
    got: collections.Counter[str] = collections.Counter()
    ids = set(insert_rows(first, topology.exchange, 3))
    wait_for(lambda: delivered(topology, got, ids), 30, "the first database's rows")
    created_at = time.monotonic()
    later = new_database(name=f"{prefix}_b")
    new = set(insert_rows(later, topology.exchange, 3))
    wait_for(lambda: delivered(topology, got, new), 10, "the new database's rows")
    assert time.monotonic() - created_at < 10
    assert f"database={prefix}_empty" not in relay.log()
    stop(relay)


def test_fleet__metrics_label_every_database_and_readyz_names_the_targets_not_ready(
    new_database: NewDatabase, targets_file: TargetsFile, run_fleet: Run, topology: Topology
) -> None:
    good, no_table = new_database(), new_database(schema=False)
    targets_file.write(good, no_table)
    port = free_port()
    relay = run_fleet(targets_file.path, OUTBOX_METRICS_PORT=str(port))
    insert_rows(good, topology.exchange, 4)
    good_name, bad_name = database_of(good), database_of(no_table)
    published = f'outbox_messages_published_total{{database="{good_name}"}} 4.0'
    wait_for(lambda: published in http_get(port, "/metrics")[1], 30, "the labelled counter")
    backlog = f'outbox_backlog_rows{{database="{good_name}"}} 0.0'  # figures cached 5 s
    wait_for(lambda: backlog in http_get(port, "/metrics")[1], 15, "the labelled backlog")
    assert http_get(port, "/healthz") == (200, "ok\n")
    status, body = http_get(port, "/readyz")
    assert status == 503 and bad_name in body and good_name not in body, body
    # The metrics endpoint keeps no session open on a target between scrapes.
    with psycopg.connect(good) as conn:
        names = [
            r[0]
            for r in conn.execute(
                "SELECT application_name FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchall()
        ]
    assert "outbox-metrics" not in names
    with psycopg.connect(no_table, autocommit=True) as conn:
        migrate.migrate(conn, "outbox")  # type: ignore[arg-type]
    wait_for(lambda: http_get(port, "/readyz")[0] == 200, 30, "every target ready")
    stop(relay)
