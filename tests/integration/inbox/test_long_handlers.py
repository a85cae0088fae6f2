"""Issue 31, item 4: a handler of any length keeps the consumer's connection alive.

py-amqp sends heartbeats only when the loop asks (between messages), so a handler
that ran for two heartbeat intervals got the connection closed by the broker: an
outage, every message in hand redelivered and applied again (its effect skipped
as a duplicate).  The consumer now sends them from a thread while handlers run
(``broker.Heartbeats``).  A private node with a heartbeat of 1 s stands for the
default 60 s, and a handler of 4 s for one of several minutes.  A handler that
outlives RabbitMQ's ``consumer_timeout`` (6 s here, 30 min by default) has its
channel closed under it: its effect commits once, the message comes back and is
skipped as a duplicate, nothing is lost.  One that outlives it many times over
meets a close at every one of the broker's channel ticks (``broker._Channel``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.faults import RabbitNode, wait_for
from tests.fixtures.servers import Topology
from tests.integration.inbox.support import (
    consumer,
    effect_bodies,
    parked_bodies,
    publish,
    scalar,
    wait_settled,
)


@pytest.fixture(scope="module")
def short_node() -> Iterator[RabbitNode]:
    node = RabbitNode("heartbeat = 1\nconsumer_timeout = 6000\n")
    node.start()
    # RabbitMQ checks consumer_timeout on each channel's tick, once a minute by
    # default: every 50 ms here (channels opened from now on), so that a handler
    # of seconds meets as many of its closes as one of an hour would.
    node.ctl("eval", "application:set_env(rabbit, channel_tick_interval, 50).")
    yield node
    node.destroy()


@pytest.fixture
def short_topology(short_node: RabbitNode) -> Iterator[Topology]:
    suffix = uuid.uuid4().hex[:10]
    topo = Topology(short_node.url, f"t.ex.{suffix}", f"t.q.{suffix}", f"t.ledger.{suffix}")
    topo.declare()
    yield topo
    topo.delete()


def test_long_handler__heartbeats_flow_while_it_runs(
    tmp_path: Path, consumer_dsn: str, short_topology: Topology
) -> None:
    """A 4 s handler on a connection with 1 s heartbeats: no outage, applied once."""
    bodies = [b"sleep:long", b"ok:after"]
    publish(short_topology, [(str(uuid.uuid4()), b) for b in bodies])
    env = {"HANDLER_SLEEP": "4"}
    with consumer(tmp_path, consumer_dsn, short_topology, env=env) as process:
        wait_settled(consumer_dsn, short_topology, bodies, timeout=30)
        output = process.output()
    assert "consumer.retry" not in output, output[-3000:]  # no outage
    assert "consumer.duplicate_skipped" not in output, output[-3000:]  # nothing came back
    assert sorted(effect_bodies(consumer_dsn)) == sorted(bodies)
    assert parked_bodies(consumer_dsn) == []


def test_long_handler__outliving_the_consumer_timeout_commits_once_and_loses_nothing(
    tmp_path: Path, consumer_dsn: str, short_topology: Topology
) -> None:
    """A 9 s handler, consumer_timeout 6 s: the broker closes the channel while it
    runs and puts the message back.  The effect commits, the ack fails (an outage:
    the consumer reconnects), the message comes back and is skipped."""
    bodies = [b"sleep:past the timeout", b"ok:after"]
    publish(short_topology, [(str(uuid.uuid4()), b) for b in bodies])
    env = {"HANDLER_SLEEP": "9"}
    with consumer(tmp_path, consumer_dsn, short_topology, env=env) as process:
        wait_settled(consumer_dsn, short_topology, bodies, timeout=40)
        output = process.output()
    assert "timed out" in output, output[-3000:]  # the broker's consumer_timeout fired
    assert "consumer.duplicate_skipped" in output, output[-3000:]  # it came back: skipped
    assert sorted(effect_bodies(consumer_dsn)) == sorted(bodies)  # each once
    assert parked_bodies(consumer_dsn) == []


def test_long_handler__far_past_the_consumer_timeout_reconnects_and_applies_what_follows(
    tmp_path: Path, consumer_dsn: str, short_topology: Topology
) -> None:
    """A 15 s handler, consumer_timeout 6 s: the broker closes the channel at each
    tick until close-ok comes (about 180 closes meanwhile, as an hour's handler
    meets with the default tick).  py-amqp answered each by reopening the channel
    and read the next one a frame deeper: RecursionError, exit 1, the messages
    published behind the long one never applied.  Now the effect commits once, the
    redelivery is skipped, the consumer reconnects and applies those behind."""
    long = b"sleep:far past the timeout"
    publish(short_topology, [(str(uuid.uuid4()), long)])
    behind = [f"ok:behind {n}".encode() for n in range(3)]
    env = {"HANDLER_SLEEP": "15"}
    with consumer(tmp_path, consumer_dsn, short_topology, env=env) as process:
        wait_for(
            lambda: (
                scalar(
                    consumer_dsn,
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                    "'outbox-consume' AND state = 'idle in transaction'",
                )
                == 1
            ),
            20,
            "the long handler to run",
        )
        publish(short_topology, [(str(uuid.uuid4()), b) for b in behind])
        wait_settled(consumer_dsn, short_topology, [long, *behind], timeout=60)
        output = process.output()
    assert "RecursionError" not in output, output[-3000:]
    assert "timed out" in output, output[-3000:]  # the broker's consumer_timeout fired
    assert "consumer.duplicate_skipped" in output, output[-3000:]  # it came back: skipped
    assert sorted(effect_bodies(consumer_dsn)) == sorted([long, *behind])  # each once
    assert parked_bodies(consumer_dsn) == []
