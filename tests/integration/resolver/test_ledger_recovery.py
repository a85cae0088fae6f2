"""The ledger stream after a kill -9 of a single RabbitMQ node: how long until it
takes records again, and the repair for the one case where it never does.

Run as a script to print the figures over several rounds (no assertions on time):

    python -m tests.integration.resolver.test_ledger_recovery [rounds]

Measured on RabbitMQ 3.10.8 (Ra 2.2.0, osiris 1.3.1, Erlang 25), one node, 2 cores:

- kill -9 of a node whose stream coordinator already existed: the node accepts
  connections again 5.5-7 s after the kill (the node's own boot), the ledger confirms
  a record 0.01-0.55 s after that, and reading it from ``first`` returns every record
  written before the kill.  Nothing is lost.  A batch sent in that gap would be
  rolled back and sent again, so the relay probes the ledger after every connect.
- kill -9 less than about 0.5-1 s after the *first stream ever declared on the node*:
  the ledger stays down for good ("home node … of durable queue … is down or
  inaccessible"; a mandatory publish comes back unroutable), not just for a while.
  That stream created the node's stream coordinator (a Ra server), whose name Ra
  writes to ``names.dets`` with dets ``auto_save`` 500 ms and no sync (fixed upstream
  in rabbitmq/ra#443).  After the restart ``rabbit_stream_coordinator:recover/0`` gets
  ``name_not_registered``, takes it for a first boot and never starts the
  coordinator.  Its Ra log and the stream's segments are intact on disk: ``REPAIR``
  re-registers the name and restarts the coordinator, and the ledger comes back with
  every record.  Declaring any *other* stream before that repair creates a new, empty
  coordinator and makes it worse (the old streams stay down even across restarts).
  Later streams on the same node do not open the window again; every new quorum
  queue does (same Ra directory).
"""

from __future__ import annotations

import dataclasses
import sys
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from outbox.amqp import ledger
from outbox.amqp.confirms import Outcome
from outbox.amqp.publisher import Publisher
from tests.fixtures.faults import RabbitNode

LEDGER = "outbox.ledger.recovery"
# A correctness bound ("it comes back at all"), not a performance figure: ~0.5 s measured.
RECOVERY_BOUND = 30.0
# How long the first-stream case is watched before the repair is applied.
STUCK_AFTER = 10.0

# rabbitmqctl eval: register the stream coordinator's existing Ra server again and
# start it.  Refuses (badmatch) if the name is registered or if there is not exactly
# one coordinator data directory of this node.
REPAIR = """
Sys = ra_system:fetch(coordination),
Dir = maps:get(data_dir, Sys),
Me = {rabbit_stream_coordinator, node()},
undefined = ra_directory:uid_of(coordination, rabbit_stream_coordinator),
[UId] = [list_to_binary(D) || D <- filelib:wildcard("*", Dir),
         {ok, [#{id := Id}]} <- [file:consult(filename:join([Dir, D, "config"]))],
         Id =:= Me],
Names = maps:get(directory_rev, maps:get(names, Sys)),
ok = dets:insert(Names, {rabbit_stream_coordinator, UId}),
ok = dets:sync(Names),
ok = rabbit_stream_coordinator:recover(),
{UId, whereis(rabbit_stream_coordinator)}.
"""

# rabbitmqctl eval: what a kill -9 inside the window leaves, made certain: the
# stream coordinator's name taken out of ``names.dets`` (never saved), its Ra log
# and the stream's segments left as they are.
FORGET_NAME = """
Names = maps:get(directory_rev, maps:get(names, ra_system:fetch(coordination))),
true = is_binary(ra_directory:uid_of(coordination, rabbit_stream_coordinator)),
ok = dets:delete(Names, rabbit_stream_coordinator),
ok = dets:sync(Names),
[] = dets:lookup(Names, rabbit_stream_coordinator),
forgotten.
"""


@dataclasses.dataclass
class Recovery:
    restart: float  # kill -9 → the node accepts connections again (or: REPAIR ran)
    publish: float | None = None  # → a ledger record confirmed (None: not within the limit)
    read: float | None = None  # → every earlier record read back from 'first'
    error: str = ""  # the last failure seen while waiting
    what: str = "node up {:.1f}s after kill -9"

    def __str__(self) -> str:
        def fmt(value: float | None) -> str:
            return "never" if value is None else f"{value:.2f}s"

        text = (
            f"{self.what.format(self.restart)}; then ledger publish {fmt(self.publish)}"
            f", read back {fmt(self.read)}"
        )
        return text + (f" (last error: {self.error})" if self.error else "")


def write_records(url: str, count: int) -> set[str]:
    """Declare the ledger as the relay does and append ``count`` confirmed records."""
    publisher = Publisher(url)
    publisher.connect()
    try:
        publisher.declare_stream(LEDGER, "7D")
        gids = {f"recovery-{uuid.uuid4().hex[:8]}" for _ in range(count)}
        records = [
            ledger.record(gid, queue=LEDGER, rows=1, dead=0, relay_id="test")
            for gid in sorted(gids)
        ]
        outcomes = {d.outcome for d in publisher.publish(records, timeout=10.0)}
        assert outcomes == {Outcome.ACCEPTED}, outcomes
        return gids
    finally:
        publisher.close()


def publish_probe(url: str) -> None:
    publisher = Publisher(url, connect_timeout=3.0)
    try:
        publisher.connect()
        probe = ledger.probe(LEDGER)
        [delivery] = publisher.publish([probe], timeout=3.0)
        if delivery.outcome is not Outcome.ACCEPTED:
            raise RuntimeError(f"ledger record {delivery.outcome.value}: {delivery.reason}")
    finally:
        publisher.close()


def _until(action: Callable[[], object], limit: float, since: float) -> tuple[float | None, str]:
    error = ""
    while time.monotonic() - since < limit:
        try:
            if action() is not False:
                return time.monotonic() - since, ""
            error = "not every record read back yet"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        time.sleep(0.25)
    return None, error


def wait_for_ledger(
    node: RabbitNode, gids: set[str], limit: float
) -> tuple[float | None, float | None, str]:
    """(publish, read, error): seconds from now until each works, or None."""
    start = time.monotonic()
    published, error = _until(lambda: publish_probe(node.url), limit, start)
    if published is None:
        return None, None, error
    read, error = _until(
        lambda: gids <= ledger.finished_gids(node.url, LEDGER, since=None, timeout=3.0),
        limit,
        start,
    )
    return published, read, error


def kill_and_measure(node: RabbitNode, gids: set[str], limit: float) -> Recovery:
    start = time.monotonic()
    node.kill()
    node.start()
    recovery = Recovery(restart=time.monotonic() - start)
    recovery.publish, recovery.read, recovery.error = wait_for_ledger(node, gids, limit)
    return recovery


def first_stream_case(
    node: RabbitNode, *, in_the_window: bool = False
) -> tuple[Recovery, Recovery | None]:
    """kill -9 right after the node's first stream; if stuck, REPAIR and measure again.
    ``in_the_window``: the kill lands in the window for certain (``FORGET_NAME``)."""
    gids = write_records(node.url, 20)
    if in_the_window:
        node.ctl("eval", FORGET_NAME)
    stuck = kill_and_measure(node, gids, STUCK_AFTER)
    if stuck.read is not None:
        return stuck, None  # the broker no longer has the window
    start = time.monotonic()
    node.ctl("eval", REPAIR)
    repaired = Recovery(restart=time.monotonic() - start, what="REPAIR took {:.1f}s")
    repaired.publish, repaired.read, repaired.error = wait_for_ledger(node, gids, RECOVERY_BOUND)
    return stuck, repaired


@pytest.fixture
def fresh_node() -> Iterator[RabbitNode]:
    """A node on which no stream was ever declared."""
    node = RabbitNode()
    node.start()
    yield node
    node.destroy()


@pytest.mark.slow
def test_kill9__ledger_takes_and_returns_records_after_restart(
    rabbit_node: RabbitNode, capsys: pytest.CaptureFixture[str]
) -> None:
    gids = write_records(rabbit_node.url, 50)

    recovery = kill_and_measure(rabbit_node, gids, RECOVERY_BOUND)

    with capsys.disabled():
        print(f"\nledger after kill -9: {recovery}")
    assert recovery.publish is not None, f"the ledger takes no records: {recovery}"
    assert recovery.read is not None, f"records written before the kill missing: {recovery}"


@pytest.mark.slow
def test_kill9_right_after_first_stream__repair_brings_the_ledger_back_whole(
    fresh_node: RabbitNode, capsys: pytest.CaptureFixture[str]
) -> None:
    """The kill is made to land in the window (a real kill lands there only within
    about 0.5-1 s of the first stream), so the REPAIR path runs every time."""
    stuck, repaired = first_stream_case(fresh_node, in_the_window=True)

    with capsys.disabled():
        print(f"\nkill -9 right after the first stream: {stuck}")
        print(f"after REPAIR: {repaired or 'not needed'}")
    assert stuck.read is None and repaired is not None, f"the ledger was not stuck: {stuck}"
    assert repaired.publish is not None, f"REPAIR did not bring the ledger back: {repaired}"
    assert repaired.read is not None, f"records lost after REPAIR: {repaired}"


def main(rounds: int) -> None:
    node = RabbitNode()
    node.start()
    node.persist_stream_coordinator()
    try:
        for n in range(1, rounds + 1):
            gids = write_records(node.url, 50)
            print(f"round {n}, coordinator existed: {kill_and_measure(node, gids, 120.0)}")
    finally:
        node.destroy()
    for n in range(1, rounds + 1):
        node = RabbitNode()
        node.start()
        try:
            stuck, repaired = first_stream_case(node)
            print(f"round {n}, kill -9 right after the first stream: {stuck}")
            print(f"round {n}, after REPAIR: {repaired or 'not needed'}")
        finally:
            node.destroy()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
