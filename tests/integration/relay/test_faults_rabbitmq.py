"""RabbitMQ going away or blocking publishers while the relay works.

These tests kill, stop and alarm the broker, so they use a private node (one for
the module); the shared broker is never touched.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterator

import pytest

from outbox.config import Settings
from outbox.relay.process import Relay
from tests.fixtures.faults import (
    RabbitNode,
    both_modes,
    check_delivery,
    in_flight,
    insert_rows,
    wait_for,
)
from tests.fixtures.servers import Topology

BATCH = 100


@pytest.fixture
def node_settings(settings: Settings, node_topology: Topology) -> Settings:
    return dataclasses.replace(
        settings,
        amqp_url=node_topology.amqp_url,
        ledger_queue=node_topology.ledger,
        batch_size=BATCH,
        publish_timeout=2.0,
    )


def _relay_thread(settings: Settings) -> Iterator[Relay]:
    relay = Relay(settings)
    relay.start()
    thread = threading.Thread(target=relay.run)
    thread.start()
    yield relay
    assert thread.is_alive(), "the relay must never exit on a broker outage"
    relay.stop.set()
    thread.join(timeout=60)


@pytest.fixture
def running_relay(node_settings: Settings) -> Iterator[Relay]:
    yield from _relay_thread(node_settings)


@pytest.fixture
def patient_relay(node_settings: Settings) -> Iterator[Relay]:
    """A relay that waits up to 30 s for confirms (a short alarm outlives nothing)."""
    yield from _relay_thread(dataclasses.replace(node_settings, publish_timeout=30.0))


def test_resource_alarm__shorter_than_the_publish_timeout_costs_no_duplicate(
    rabbit_node: RabbitNode,
    node_settings: Settings,
    node_topology: Topology,
    patient_relay: Relay,
) -> None:
    """An alarm that clears within ``publish_timeout`` costs nothing: the batch
    published into the blocked connection is confirmed once it clears, whether the
    relay was waiting for its confirms or had noticed the alarm before its next claim
    (``BrokerBlocked``: the batch is kept, not rolled back; that order is pinned by
    ``tests/unit/relay/test_batches.py``, ``…a_resource_alarm_before_the_next_claim…``)."""
    rabbit_node.ctl("set_vm_memory_high_watermark", "0")
    try:
        committed = insert_rows(node_settings.dsn, node_topology.exchange, 250)
        wait_for(lambda: patient_relay.publisher.blocked, 30, "the connection to be blocked")
        time.sleep(3)  # several retries while blocked, far within the publish timeout
        assert patient_relay.stats.batches_committed == 0
    finally:
        rabbit_node.ctl("set_vm_memory_high_watermark", "0.4")
    wait_for(lambda: patient_relay.stats.messages_published == 250, 60, "delivery after the alarm")
    assert patient_relay.stats.batches_rolled_back == 0
    check_delivery(node_settings.dsn, node_topology, committed, max_duplicates=0)


@both_modes
@pytest.mark.parametrize("outage", ["stop_app", pytest.param("kill-9", marks=pytest.mark.slow)])
def test_broker_restart__relay_reconnects_and_loses_nothing(
    outage: str,
    rabbit_node: RabbitNode,
    node_settings: Settings,
    node_topology: Topology,
    running_relay: Relay,
) -> None:
    committed = insert_rows(node_settings.dsn, node_topology.exchange, 3000)
    wait_for(lambda: running_relay.stats.messages_published > 0, 30, "publishing to start")
    if outage == "kill-9":
        rabbit_node.kill()
        rabbit_node.start()
    else:
        rabbit_node.ctl("stop_app")
        rabbit_node.ctl("start_app")
        wait_for(rabbit_node.accepts_connections, 30, "the broker to accept connections")
    committed += insert_rows(node_settings.dsn, node_topology.exchange, 50, tag="after")

    wait_for(lambda: running_relay.stats.messages_published >= len(committed), 90, "the backlog")

    assert running_relay.stats.reconnects >= 1
    # Only the batches in flight when the broker went away can arrive twice.
    check_delivery(
        node_settings.dsn,
        node_topology,
        committed,
        max_duplicates=in_flight(node_settings) * BATCH,
    )


@both_modes
def test_resource_alarm__relay_waits_while_blocked_then_delivers(
    rabbit_node: RabbitNode,
    node_settings: Settings,
    node_topology: Topology,
    running_relay: Relay,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="outbox")
    rabbit_node.ctl("set_vm_memory_high_watermark", "0")
    try:
        committed = insert_rows(node_settings.dsn, node_topology.exchange, 250)
        wait_for(lambda: running_relay.publisher.blocked, 30, "the connection to be blocked")
        wait_for(
            lambda: running_relay.stats.batches_rolled_back >= 1,
            30,
            "the blocked batch to time out",
        )
        retries_while_blocked = sum("relay.retry" in r.message for r in caplog.records)
        assert running_relay.stats.batches_committed == 0
    finally:
        rabbit_node.ctl("set_vm_memory_high_watermark", "0.4")

    wait_for(lambda: running_relay.stats.messages_published == 250, 60, "delivery after the alarm")

    # It backed off while blocked instead of spinning, and claimed nothing new.
    assert retries_while_blocked < 50
    # The batch published into the blocked connection timed out; pipelined, the
    # next one may have been prepared before the alarm was noticed, or published
    # beside it while its confirms were due (``batches.py``, "the schedule").
    assert 1 <= running_relay.stats.batches_rolled_back <= in_flight(node_settings)
    # Only the batches published into the blocked connection may arrive twice.
    check_delivery(
        node_settings.dsn,
        node_topology,
        committed,
        max_duplicates=in_flight(node_settings) * BATCH,
    )
