"""Several ``--amqp-url``s (a cluster's nodes, ';'-separated) against the local broker.

A node that is down is a free port where nothing listens, or a cuttable proxy in
front of the real broker.  The three-node cluster itself is in
``test_rabbitmq_cluster.py``; these check the rules of trying nodes, quickly.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time

import pytest

from outbox.amqp import ledger
from outbox.amqp.publisher import Message, Outcome, Publisher
from outbox.config import Settings
from outbox.db.devcluster import free_port
from outbox.errors import BrokerUnavailable, OutboxError
from outbox.urls import parse_amqp_urls
from tests.fixtures.faults import (
    RelayProcess,
    TcpProxy,
    check_delivery,
    drain,
    insert_rows,
    proxied_amqp_url,
    relay_sessions,
    wait_for,
)
from tests.fixtures.servers import Topology, run_cli, settings_env


def dead_node() -> str:
    """The URL of a node that is down (nothing listens on its port)."""
    return f"amqp://guest:guest@127.0.0.1:{free_port()}/%2F"


def where(url: str) -> str:
    return parse_amqp_urls(url)[0].describe()


def record(topology: Topology, gid: str) -> None:
    publisher = Publisher(topology.amqp_url)
    publisher.connect()
    try:
        publisher.declare_stream(topology.ledger, "1h")
        entry = ledger.record(gid, queue=topology.ledger, rows=1, dead=0, relay_id="test")
        [delivery] = publisher.publish([entry], timeout=10)
        assert delivery.outcome is Outcome.ACCEPTED
    finally:
        publisher.close()


def test_publisher__connects_to_the_first_node_that_answers(topology: Topology) -> None:
    down = dead_node()
    publisher = Publisher(f"{down};{topology.amqp_url}", connect_timeout=3)
    try:
        publisher.connect()
        assert publisher.nodes == 2
        assert publisher.address == where(topology.amqp_url)
        message = Message(exchange=topology.exchange, routing_key="k", body=b"x", message_id="m")
        [delivery] = publisher.publish([message], timeout=10)
        assert delivery.outcome is Outcome.ACCEPTED
    finally:
        publisher.close()
    assert len(topology.messages()) == 1


def test_publisher__after_losing_its_node_starts_with_the_next(topology: Topology) -> None:
    proxy = TcpProxy("127.0.0.1", int(parse_amqp_urls(topology.amqp_url)[0].port))
    first = proxied_amqp_url(topology.amqp_url, proxy)
    publisher = Publisher(f"{first};{topology.amqp_url}", connect_timeout=3)
    try:
        publisher.connect()
        assert publisher.address == where(first)
        proxy.cut_all()
        publisher.wait(1.0)
        assert not publisher.connected
        # The proxy still accepts connections: the second node is tried first
        # because the first is the one that failed.
        publisher.connect()
        assert publisher.address == where(topology.amqp_url)
        publisher.close()
        # Round and round: the next connection starts after the second node.
        publisher.connect()
        assert publisher.address == where(first)
    finally:
        publisher.close()
        proxy.close()


def test_publisher__every_node_down_names_each_one() -> None:
    nodes = [dead_node(), dead_node()]
    publisher = Publisher(";".join(nodes), connect_timeout=2)
    with pytest.raises(BrokerUnavailable) as failure:
        publisher.connect()
    message = failure.value.message
    assert message.startswith("cannot connect to any RabbitMQ node: ")
    for node in nodes:
        assert f"{where(node)}: Connection refused" in message
    assert "guest" not in message


def test_publisher__one_node_down_says_what_it_always_said() -> None:
    node = dead_node()
    with pytest.raises(BrokerUnavailable) as failure:
        Publisher(node, connect_timeout=2).connect()
    assert (
        failure.value.message == f"cannot connect to RabbitMQ at {where(node)}: Connection refused"
    )


def test_ledger__read_through_the_first_node_that_answers(topology: Topology) -> None:
    record(topology, "obx:outbox:failover:1")

    found = ledger.finished_gids(
        f"{dead_node()};{topology.amqp_url}", topology.ledger, since=None, timeout=5
    )

    assert "obx:outbox:failover:1" in found


def test_ledger__one_node_down_fails_at_once_several_are_retried_until_the_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(BrokerUnavailable) as one:
        ledger.finished_gids(dead_node(), "outbox.ledger", since=None, timeout=5)
    assert time.monotonic() - started < 2
    assert one.value.message.startswith("cannot connect to RabbitMQ at ")

    started = time.monotonic()
    with pytest.raises(BrokerUnavailable) as several:
        ledger.finished_gids(
            f"{dead_node()};{dead_node()}", "outbox.ledger", since=None, timeout=1.5
        )
    assert 1.5 <= time.monotonic() - started < 5
    assert several.value.message.startswith("cannot read the ledger through any RabbitMQ node: ")


def test_ledger__a_missing_stream_is_an_error_not_an_outage(topology: Topology) -> None:
    with pytest.raises(OutboxError) as missing:
        ledger.finished_gids(
            f"{dead_node()};{topology.amqp_url}", topology.ledger, since=None, timeout=5
        )
    assert not isinstance(missing.value, BrokerUnavailable)
    assert "does not exist" in missing.value.message


def test_relay_and_resolve__skip_a_node_that_is_down(
    settings: Settings, topology: Topology
) -> None:
    cluster = dataclasses.replace(
        settings, amqp_url=f"{dead_node()};{topology.amqp_url}", batch_size=10, pipeline=False
    )
    committed = insert_rows(cluster.dsn, topology.exchange, 25)
    relay = RelayProcess(cluster, crash_at="before_commit_prepared")
    try:
        assert relay.wait() == -signal.SIGKILL, relay.output()
        assert f"broker.connected node={where(topology.amqp_url)}" in relay.output()
    finally:
        relay.close()
    wait_for(lambda: relay_sessions(cluster.dsn) == 0, 10, "the dead relay's sessions to end")

    result = run_cli("resolve", "--json", env=settings_env(cluster))

    assert result.returncode == 0, result.stderr
    [batch] = json.loads(result.stdout)["batches"]
    assert (batch["evidence"], batch["outcome"]) == (True, "committed")
    drain(cluster)
    report = check_delivery(cluster.dsn, topology, committed, max_duplicates=0)
    assert report.duplicates == 0
