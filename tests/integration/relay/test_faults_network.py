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
from outbox.relay.process import Relay
from tests.fixtures.faults import (
    TcpProxy,
    both_modes,
    check_delivery,
    in_flight,
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


@both_modes
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
    # A cut PREPARE publishes nothing; a cut COMMIT PREPARED is committed exactly once;
    # pipelined, the batch published meanwhile is finished after the reconnect.
    assert relay.stats.messages_published == ROWS
    assert relay.stats.duplicates_possible == 0
    report = check_delivery(settings.dsn, topology, committed, max_duplicates=0)
    assert report.duplicates == 0


@pytest.mark.parametrize("after_server", [False, True], ids=["not-run", "reply-lost"])
def test_pg_cut__prepare_of_next_batch_while_one_is_in_flight_costs_no_duplicate(
    after_server: bool, settings: Settings, topology: Topology, pg_proxy: TcpProxy
) -> None:
    relay_settings = dataclasses.replace(
        settings, dsn=proxied_dsn(settings.dsn, pg_proxy), batch_size=BATCH, pipeline=True
    )
    committed = insert_rows(settings.dsn, topology.exchange, ROWS)
    # Batch 2's PREPARE, cut while batch 1 is published and awaiting its confirms:
    # batch 2 is settled by looking its gid up, batch 1 finished after the reconnect.
    pg_proxy.arm(b"PREPARE TRANSACTION", after_server=after_server, skip=1)

    relay = run_relay(relay_settings)

    assert pg_proxy.triggered.is_set()
    assert relay.stats.reconnects >= 1
    assert relay.stats.batches_rolled_back == 1  # batch 2: rolled back, or never prepared
    assert relay.stats.messages_published == ROWS
    report = check_delivery(settings.dsn, topology, committed, max_duplicates=0)
    assert report.duplicates == 0


@both_modes
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
    report = check_delivery(settings.dsn, topology, committed, max_duplicates=BATCH)
    if not settings.pipeline:
        assert relay.stats.batches_rolled_back == 1
    else:
        # Batch 2 is cut before the broker saw any of it.  The second batch in flight
        # is either batch 1 (confirmed, its ledger record sent just before the cut:
        # committed if that confirm made it back, else rolled back and all of it
        # sent again) or batch 3 (prepared, nothing published: rolled back free).
        assert relay.stats.batches_rolled_back in (1, 2)
        assert report.duplicates in (0, BATCH)
        assert report.duplicates <= BATCH * (relay.stats.batches_rolled_back - 1)


@both_modes
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
    # Every message of that batch was confirmed, then rolled back: the batch again.
    # Pipelined, batch 2 is rolled back too: published after that ledger record
    # (the broker got none of it, unless the proxy read its first bytes in the same
    # read), or before it, beside batch 1 while batch 1's confirms were due
    # (``batches.py``, "the schedule"): then the broker may have all of it.
    assert relay.stats.batches_rolled_back == in_flight(settings)
    report = check_delivery(settings.dsn, topology, committed, max_duplicates=2 * BATCH)
    if settings.pipeline:
        assert BATCH <= report.duplicates <= 2 * BATCH
    else:
        assert report.duplicates == BATCH
