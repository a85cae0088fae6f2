"""The single-database relay's promises, per database, from one fleet process: a
network partition from PostgreSQL and a PostgreSQL crash restart, with two databases
served at once (kill -9 at each crash point: the relay fault files run with
``OUTBOX_TEST_RELAY=fleet``, ``tests/fixtures/faults.py``)."""

from __future__ import annotations

import collections
import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator

import psycopg
import pytest

from outbox.config import Settings
from outbox.db.devcluster import PostgresCluster
from tests.fixtures.faults import (
    RelayProcess,
    TcpProxy,
    arrived,
    insert_rows,
    prepared_left,
    proxied_dsn,
    relay_sessions,
    rows_left,
    wait_for,
)
from tests.fixtures.servers import Topology
from tests.integration.fleet.conftest import NewDatabase, TargetsFile
from tests.integration.relay.test_faults_postgres import _database as new_cluster_database

pytestmark = pytest.mark.fleet_faults

Run = Callable[..., RelayProcess]


def writing(dsns: list[str], exchange: str) -> tuple[list[str], threading.Event, threading.Thread]:
    """A writer committing a few rows to each database in turn until the event is set."""
    committed: list[str] = []
    done = threading.Event()

    def write() -> None:
        n = 0
        while not done.is_set():
            n += 1
            for dsn in dsns:
                # The server restarting: these rows were never committed.
                with contextlib.suppress(psycopg.OperationalError):
                    committed.extend(insert_rows(dsn, exchange, 5, tag=f"w{n}-"))
            time.sleep(0.05)

    thread = threading.Thread(target=write)
    thread.start()
    return committed, done, thread


def finish(
    relay: RelayProcess,
    dsns: list[str],
    topology: Topology,
    committed: list[str],
    got: collections.Counter[str] | None = None,
) -> collections.Counter[str]:
    """Wait for every committed row (``got``: those taken off the queue before), stop
    the fleet (exit 0), check each database; every copy that arrived, by id."""
    got = collections.Counter() if got is None else got

    def all_in() -> bool:
        got.update(arrived(topology))
        return set(committed) <= set(got)

    wait_for(all_in, 60, "every committed row")
    relay.process.send_signal(signal.SIGTERM)
    assert relay.wait() == 0, relay.output()
    got.update(arrived(topology))
    for dsn in dsns:
        wait_for(lambda dsn=dsn: prepared_left(dsn) == [], 30, "no prepared transaction")
        assert rows_left(dsn) == 0
    assert set(got) == set(committed), "a message nobody committed"
    return got


def test_fleet_partition__both_databases_cut_twice_lose_nothing(
    new_database: NewDatabase,
    targets_file: TargetsFile,
    run_fleet: Run,
    topology: Topology,
    pg_proxy: TcpProxy,
) -> None:
    dsns = [new_database(), new_database()]
    targets_file.write(*(proxied_dsn(dsn, pg_proxy) for dsn in dsns))
    relay = run_fleet(targets_file.path, OUTBOX_BATCH_SIZE="20")
    for dsn in dsns:  # every relay up: work, control and wake-up sessions
        wait_for(lambda dsn=dsn: relay_sessions(dsn) == 3, 60, "the fleet to start")
    committed = [i for dsn in dsns for i in insert_rows(dsn, topology.exchange, 2000)]
    more, done, writer = writing(dsns, topology.exchange)
    try:
        for _ in range(2):
            time.sleep(0.5)
            assert pg_proxy.pairs
            pg_proxy.cut_all()  # every session of both databases at once
    finally:
        done.set()
        writer.join()
    got = finish(relay, dsns, topology, committed + more)
    output = relay.log()
    for dsn in dsns:
        name = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
        lines = [line for line in output.splitlines() if f"database={name} " in line]
        assert any("relay.retry" in line for line in lines), "\n".join(lines[-30:])
    # A cut is a crash window of the batches in flight: at most two per database.
    assert sum(n - 1 for n in got.values()) <= 2 * 2 * 2 * 20


@pytest.fixture(scope="module")
def cluster() -> Iterator[PostgresCluster]:
    pg = PostgresCluster(durable=False, max_prepared_transactions=20)
    pg.start()
    yield pg
    pg.destroy()


def test_fleet_postgres_crash__every_database_carries_on_without_duplicates(
    cluster: PostgresCluster,
    targets_file: TargetsFile,
    settings: Settings,
    topology: Topology,
) -> None:
    dsns = [new_cluster_database(cluster, schema=True) for _ in range(2)]
    targets_file.write(*dsns)
    committed = [i for dsn in dsns for i in insert_rows(dsn, topology.exchange, 1000)]
    relay = RelayProcess(settings, extra_env={"OUTBOX_TARGETS": targets_file.path})
    try:
        got: collections.Counter[str] = collections.Counter()
        wait_for(lambda: got.update(arrived(topology)) or len(got) > 0, 30, "publishing")
        cluster.stop("immediate")  # a crash, mid-stream: batches of both databases in flight
        cluster.start()
        for dsn in dsns:
            committed += insert_rows(dsn, topology.exchange, 50, tag="after")
        got = finish(relay, dsns, topology, committed, got)
        # Each relay takes its relay id back after the restart and finishes the batches
        # it published (the hand-over): none is rolled back, in either database.
        assert max(got.values()) == 1, relay.output()
    finally:
        relay.close()
