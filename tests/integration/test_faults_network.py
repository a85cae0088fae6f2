"""Connections cut at the worst moments, through a proxy the test controls.

PostgreSQL: the work connection is cut while PREPARE or COMMIT PREPARED is on the
wire, either before the server ran it or after (reply lost).  The relay must never
publish a batch whose PREPARE it could not confirm, and must look up the fate of
a cut-off COMMIT PREPARED.  RabbitMQ: the connection is cut mid-batch and while
the ledger record is on the wire.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest

from outbox.config import Settings
from outbox.relay import Relay
from tests.fixtures.faults import (
    TcpProxy,
    check_delivery,
    insert_rows,
    proxied_amqp_url,
    proxied_dsn,
)
from tests.fixtures.servers import Topology

BATCH = 10
ROWS = 25


def run_relay(settings: Settings) -> Relay:
    """Drain with an in-process relay; fails the test if it does not finish."""
    relay = Relay(settings)
    relay.start()
    thread = threading.Thread(target=relay.run, kwargs={"drain": True})
    thread.start()
    thread.join(timeout=60)
    if thread.is_alive():
        relay.stop.set()
        thread.join(timeout=30)
        pytest.fail("the relay did not drain the outbox after the cut")
    return relay


@pytest.mark.parametrize(
    ("statement", "after_server"),
    [
        (b"PREPARE TRANSACTION", False),
        (b"PREPARE TRANSACTION", True),
        (b"COMMIT PREPARED", False),
        (b"COMMIT PREPARED", True),
    ],
    ids=["prepare-not-run", "prepare-reply-lost", "commit-not-run", "commit-reply-lost"],
)
def test_pg_cut__relay_settles_cut_off_statement_without_duplicates(
    statement: bytes,
    after_server: bool,
    settings: Settings,
    topology: Topology,
    pg_proxy: TcpProxy,
) -> None:
    relay_settings = dataclasses.replace(
        settings, dsn=proxied_dsn(settings.dsn, pg_proxy), batch_size=BATCH
    )
    committed = insert_rows(settings.dsn, topology.exchange, ROWS)
    pg_proxy.arm(statement, after_server=after_server)

    relay = run_relay(relay_settings)

    assert pg_proxy.triggered.is_set()
    assert relay.stats.reconnects >= 1
    # A cut PREPARE publishes nothing; a cut COMMIT PREPARED is committed exactly once.
    assert relay.stats.messages_published == ROWS
    assert relay.stats.duplicates_possible == 0
    report = check_delivery(settings.dsn, topology, committed, max_duplicates=0)
    assert report.duplicates == 0


def test_amqp_cut__mid_batch_rolls_back_and_republishes(
    settings: Settings, topology: Topology, amqp_proxy: TcpProxy
) -> None:
    relay_settings = dataclasses.replace(
        settings, amqp_url=proxied_amqp_url(settings.amqp_url, amqp_proxy), batch_size=BATCH
    )
    committed = insert_rows(settings.dsn, topology.exchange, ROWS, tag="row-")
    amqp_proxy.arm(b"row-15")  # in the second batch

    relay = run_relay(relay_settings)

    assert amqp_proxy.triggered.is_set()
    assert relay.stats.batches_rolled_back == 1
    check_delivery(settings.dsn, topology, committed, max_duplicates=BATCH)


@pytest.mark.parametrize("after_server", [False, True], ids=["record-not-sent", "confirm-lost"])
def test_amqp_cut__ledger_record_unconfirmed_means_rollback(
    after_server: bool, settings: Settings, topology: Topology, amqp_proxy: TcpProxy
) -> None:
    relay_settings = dataclasses.replace(
        settings, amqp_url=proxied_amqp_url(settings.amqp_url, amqp_proxy), batch_size=BATCH
    )
    committed = insert_rows(settings.dsn, topology.exchange, ROWS)
    amqp_proxy.arm(b"ledger:obx:", after_server=after_server)

    relay = run_relay(relay_settings)

    assert amqp_proxy.triggered.is_set()
    assert relay.stats.batches_rolled_back == 1
    # Every message of that batch was confirmed, then rolled back: the batch again.
    report = check_delivery(settings.dsn, topology, committed, max_duplicates=BATCH)
    assert report.duplicates == BATCH
