"""Dormancy (``outbox.relay.process``): an idle target of a fleet keeps one PostgreSQL
session, a commit wakes it, and so does a dead relay's prepared batch."""

from __future__ import annotations

import collections
import signal
from collections.abc import Callable

import psycopg

from outbox.config import Settings
from outbox.db.batches import BatchStore
from outbox.gid import Gid
from outbox.relay.liveness import Liveness
from tests.fixtures.faults import (
    RelayProcess,
    arrived,
    insert_rows,
    prepared_left,
    rows_left,
    wait_for,
)
from tests.fixtures.servers import Topology
from tests.integration.fleet.conftest import NewDatabase, TargetsFile

Run = Callable[..., RelayProcess]


def sessions(dsn: str) -> list[str]:
    """application_name of every other session on ``dsn``'s database."""
    with psycopg.connect(dsn) as conn:
        return [
            str(name)
            for (name,) in conn.execute(
                "SELECT application_name FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND backend_type = 'client backend'"
            ).fetchall()
        ]


def test_dormancy__an_idle_target_holds_one_session_and_a_commit_wakes_it(
    new_database: NewDatabase, targets_file: TargetsFile, run_fleet: Run, topology: Topology
) -> None:
    busy, idle = new_database(), new_database()
    targets_file.write(busy, idle)
    relay = run_fleet(targets_file.path, OUTBOX_DORMANT_AFTER="1")
    # Both start with three sessions (work, control, wake-up) and go dormant.
    wait_for(lambda: sessions(idle) == ["outbox-relay-wakeup"], 20, "the idle target dormant")
    wait_for(lambda: sessions(busy) == ["outbox-relay-wakeup"], 5, "the other one too")
    assert "relay.dormant" in relay.log()
    got: collections.Counter[str] = collections.Counter()
    ids = set(insert_rows(idle, topology.exchange, 3))

    def arrived_all() -> bool:
        got.update(arrived(topology))
        return ids <= set(got)

    wait_for(arrived_all, 5, "the committed row, after the wake-up")
    assert "relay.woken database=" in relay.log()
    assert "reason=notify" in relay.log()
    # Awake, then dormant again once idle.
    wait_for(lambda: sessions(idle) == ["outbox-relay-wakeup"], 10, "dormant again")
    relay.process.send_signal(signal.SIGTERM)
    assert relay.wait() == 0, relay.output()  # stopped while dormant: exit 0
    assert sessions(idle) == [] and sessions(busy) == []


def test_dormancy__a_dead_relays_prepared_batch_wakes_a_dormant_target(
    new_database: NewDatabase,
    targets_file: TargetsFile,
    run_fleet: Run,
    topology: Topology,
    settings: Settings,
) -> None:
    dsn = new_database()
    ids = set(insert_rows(dsn, topology.exchange, 5))
    # Another relay, alive, claims and prepares the rows (its batch published nowhere).
    other = Liveness.start(dsn, "outbox", interval=0.5, connect_timeout=3, statement_timeout=5)
    store = BatchStore(dsn, "outbox", statement_timeout=30)
    try:
        assert len(store.claim_batch(100)) == 5
        store.prepare(str(Gid("outbox", other.relay_id, 1)))
    finally:
        store.close()
    targets_file.write(dsn)
    # No fallback poll to find the rows: only the look for orphaned batches wakes it.
    relay = run_fleet(targets_file.path, OUTBOX_DORMANT_AFTER="1", OUTBOX_POLL_INTERVAL="60")
    wait_for(
        lambda: sessions(dsn).count("outbox-relay-wakeup") == 1 and len(sessions(dsn)) == 2,
        20,
        "the fleet dormant beside the live relay",
    )
    assert len(prepared_left(dsn)) == 1  # the live relay's batch is left alone
    other.stop(unregister=False)  # the other relay dies: its lock goes with its session

    got: collections.Counter[str] = collections.Counter()

    def arrived_all() -> bool:
        got.update(arrived(topology))
        return ids <= set(got)

    wait_for(arrived_all, 10, "the rows of the dead relay's batch")
    assert "reason=orphaned_batches" in relay.log()
    assert prepared_left(dsn) == [] and rows_left(dsn) == 0
    relay.process.send_signal(signal.SIGTERM)
    assert relay.wait() == 0, relay.output()
