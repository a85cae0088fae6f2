"""Upgrades from every earlier release, as docs/how-to/upgrading.md says to do them
(issue 19, item 4).

For each release in CHANGELOG.md (its code from this repository's history, see
``tests/fixtures/releases.py``): its own ``outbox init`` creates the schema, an
application keeps committing rows while two relays of that release publish them,
the current ``outbox init`` migrates under their feet, two current relays start
and the old ones are stopped (both versions side by side for a moment), and the
new relays drain the table.  Every committed row must arrive exactly once, nothing
may stay prepared, and the application's slowest INSERT during the upgrade is
printed and held to the bound of the online-upgrade tests.
"""

from __future__ import annotations

import datetime
import pathlib
import time

import psycopg
import pytest

import outbox
from outbox.config import Settings
from outbox.db import migrate
from tests.fixtures.application import Application
from tests.fixtures.faults import check_delivery, rows_left, wait_for
from tests.fixtures.releases import (
    UPGRADES_FROM,
    extract,
    relays,
    release,
    release_trees,
    run_release,
)
from tests.fixtures.servers import Topology, run_cli, settings_env

__all__ = ["release_trees"]  # the fixture, used by name

INSERT_BOUND = 1.5  # as in test_online_upgrade.py


def schema_version(dsn: str) -> int | None:
    with psycopg.connect(dsn) as conn:
        return migrate.current_version(conn, "outbox")  # type: ignore[arg-type]


def scheduled_left(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM outbox_scheduled").fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("version", [r.version for r in UPGRADES_FROM])
def test_upgrade__from_release_while_its_relays_run_every_row_once(
    version: str, empty_dsn: str, topology: Topology, release_trees: pathlib.Path
) -> None:
    old = release(version)
    tree = extract(old, release_trees)
    settings = Settings(
        dsn=empty_dsn,
        amqp_url=topology.amqp_url,
        ledger_queue=topology.ledger,
        batch_size=50,
        poll_interval=0.5,
        heartbeat_interval=0.5,
        relay_timeout=5.0,
        resolve_interval=1.0,
        backoff_initial=0.05,
        backoff_max=0.5,
        connect_timeout=3.0,
    )
    env = settings_env(settings)
    created = run_release(tree, "init", env=env)
    assert created.returncode == 0, created.stderr
    assert schema_version(empty_dsn) == old.schema

    with (
        Application(empty_dsn, topology.exchange, pause=0.002, statement_timeout=10) as app,
        relays(tree, settings, 2) as old_relays,
    ):
        app.wait_for_rows(200)
        time.sleep(0.5)  # the old relays are publishing
        upgrade_started = time.monotonic()
        migrated = run_cli("init", env=env, timeout=60)
        init_seconds = time.monotonic() - upgrade_started
        assert migrated.returncode == 0, migrated.stdout + migrated.stderr
        assert schema_version(empty_dsn) == migrate.LATEST_VERSION
        if old.schema < migrate.LATEST_VERSION:
            # An old relay that (re)starts now refuses the newer schema: exit 5.
            with relays(tree, settings, 1) as [late]:
                assert late.process.wait(timeout=60) == 5, late.output()
                assert "newer than this outbox-relay knows" in late.output(), late.output()
        time.sleep(0.5)  # the old relays go on publishing on the new schema
        with relays(None, settings, 2) as new_relays:
            # Both versions side by side.  Started, not just spawned: on a loaded machine
            # a relay still importing when SIGTERM comes dies of it (-15, no output).
            for relay in new_relays:
                wait_for(lambda r=relay: "relay.registered" in r.output(), 60, "a new relay")
            for relay in old_relays:
                assert relay.stop() == 0, relay.output()
            replaced = time.monotonic()
            # Scheduled rows (schema 9), written now, go out when due.
            with psycopg.connect(empty_dsn) as conn:
                scheduled = [
                    str(
                        outbox.enqueue(
                            conn,
                            exchange=topology.exchange,
                            routing_key="later",
                            payload=b"later",
                            delay=datetime.timedelta(seconds=0.5),
                        )
                    )
                    for _ in range(5)
                ]
            app.wait_for_rows(len(app.writes) + 200)
            app.stop()
            wait_for(lambda: scheduled_left(empty_dsn) == 0, 30, "the scheduled rows to come due")
            wait_for(lambda: rows_left(empty_dsn) == 0, 60, "the new relays to drain the outbox")
            for relay in new_relays:
                assert relay.stop() == 0, relay.output()

    report = check_delivery(empty_dsn, topology, [*app.committed, *scheduled], max_duplicates=0)
    during = app.slowest(upgrade_started, replaced)
    before = app.slowest(0, upgrade_started)
    print(
        f"upgrade from {version} (schema {old.schema} -> {migrate.LATEST_VERSION}): "
        f"outbox init took {init_seconds:.2f}s; slowest INSERT during the upgrade "
        f"{during * 1000:.0f} ms (before it: {before * 1000:.0f} ms); "
        f"{len(report.counts)} rows, each delivered once; outbox init said:\n"
        f"{migrated.stderr}{migrated.stdout}"
    )
    assert not app.errors, app.errors[:3]
    assert during < INSERT_BOUND, f"an INSERT waited {during:.2f}s during the upgrade"
