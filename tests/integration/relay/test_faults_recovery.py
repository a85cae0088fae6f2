"""How soon a relay publishes again once both servers are back from an outage.

A soak run (``outbox bench --soak``) saw a relay publish nothing for 40 s after the
broker had been down 22 s and PostgreSQL then restarted: the reconnect backoff had
grown to its ceiling across the outage, and the relay slept it out (twice: the
broker's wait, then the failure on the database session the restart had killed
while it slept) after both servers were back.  The relay now knocks on a lost
server while it waits and reconnects once it answers again (``outbox.relay.recovery``).

A private RabbitMQ node (``stop_app``/``start_app``) and a private PostgreSQL
cluster (restarted), as the other fault tests.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from outbox.config import Settings
from outbox.db import migrate
from outbox.db.devcluster import PostgresCluster
from outbox.relay.process import Relay
from tests.fixtures.faults import RabbitNode, check_delivery, insert_rows, wait_for
from tests.fixtures.servers import Topology

# The users' promise: publishing again within seconds of the servers being back.
RECOVERY_BOUND = 5.0
# The backoff of the test relay: its fifth pause is 8-16 s (the default's 0.2 s
# first step reaches such pauses after a 20 s outage, as in the soak).
BACKOFF_INITIAL = 1.0
LONG_PAUSE = 9.0
RETRY = re.compile(r"relay\.retry .*?sleep=([\d.]+)s")


@pytest.fixture(scope="module")
def cluster() -> Iterator[PostgresCluster]:
    pg = PostgresCluster(durable=False, max_prepared_transactions=10)
    pg.start()
    yield pg
    pg.destroy()


@pytest.fixture
def recovery_settings(
    cluster: PostgresCluster, settings: Settings, node_topology: Topology
) -> Settings:
    name = f"r_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = psycopg.conninfo.make_conninfo(cluster.dsn, dbname=name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate.migrate(conn, "outbox")  # type: ignore[arg-type]
    return dataclasses.replace(
        settings,
        dsn=dsn,
        amqp_url=node_topology.amqp_url,
        ledger_queue=node_topology.ledger,
        batch_size=100,
        publish_timeout=2.0,
        backoff_initial=BACKOFF_INITIAL,
        backoff_max=30.0,
    )


def longest_pause(caplog: pytest.LogCaptureFixture) -> float:
    found = (RETRY.search(record.getMessage()) for record in caplog.records)
    return max((float(match[1]) for match in found if match), default=0.0)


def test_broker_outage_then_postgres_restart__relay_publishes_within_seconds(
    rabbit_node: RabbitNode,
    cluster: PostgresCluster,
    node_topology: Topology,
    recovery_settings: Settings,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The soak's sequence: the broker down until the backoff is long, rows written
    meanwhile, the broker back, PostgreSQL restarted: the relay publishes within
    ``RECOVERY_BOUND`` of both being back (it slept 10-50 s more before)."""
    caplog.set_level(logging.INFO, logger="outbox")
    settings = recovery_settings
    relay = Relay(settings)
    relay.start()
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        committed = insert_rows(settings.dsn, node_topology.exchange, 50)
        wait_for(lambda: relay.stats.messages_published >= 50, 30, "publishing to start")

        rabbit_node.ctl("stop_app")
        try:
            committed += insert_rows(settings.dsn, node_topology.exchange, 300, tag="down")
            wait_for(
                lambda: longest_pause(caplog) >= LONG_PAUSE,
                40,
                f"the backoff to reach a {LONG_PAUSE:g} s pause",
            )
        finally:
            rabbit_node.ctl("start_app")
        cluster.restart()
        back = time.monotonic()
        published = relay.stats.messages_published
        wait_for(
            lambda: relay.stats.messages_published > published,
            60,
            "the first message published after both servers are back",
        )
        recovered = time.monotonic() - back
        wait_for(lambda: relay.stats.messages_published >= len(committed), 60, "the backlog")
    finally:
        relay.stop.set()
        thread.join(timeout=60)
    events = [
        record.getMessage()
        for record in caplog.records
        if "relay.retry" in record.getMessage() or "relay.server_back" in record.getMessage()
    ]
    print(f"first publish {recovered:.2f} s after both servers were back; events: {events}")
    assert not thread.is_alive()
    assert recovered <= RECOVERY_BOUND, events[-6:]
    check_delivery(settings.dsn, node_topology, committed, max_duplicates=settings.batch_size * 2)
