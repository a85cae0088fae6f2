"""Adversarial checks of three changes: the claim's hashed own-rows lookup, ``jit =
off`` per claim transaction, and a resource alarm keeping the batch already published.

Every relay test ends with the invariants: nothing lost, nothing prepared left,
duplicates within the documented bound, each ordering key in ``id`` order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import tuple_row

from outbox.config import Settings
from outbox.db.batches import BatchStore
from outbox.message import DeadLetter
from outbox.relay.process import Relay
from tests.fixtures.faults import (
    RabbitNode,
    RelayProcess,
    both_modes,
    in_flight,
    prepared_left,
    rows_left,
    wait_for,
)
from tests.fixtures.servers import Topology
from tests.integration.relay.test_ordering import (
    assert_in_order,
    keyed_rows,
    per_key,
    write_sequence,
)


def check_ordered(
    dsn: str, topology: Topology, committed: list[str], counters: dict[str, int], bound: int
) -> None:
    """The checker, then each key's order as a single consumer dropping repeats sees it."""
    messages = topology.messages(idle=1.0)
    assert prepared_left(dsn) == []
    assert rows_left(dsn) == 0
    order, repeats = per_key(messages)
    assert repeats <= bound, f"{repeats} duplicates > bound {bound}"
    assert_in_order(order, counters)
    assert sum(len(v) for v in order.values()) == len(committed)


# -- 1. the keyed window: NOT IN (SELECT unnest(own)) --------------------------------------
def test_claim__own_empty_large_or_foreign_under_the_generic_plan(
    dsn: str, stores: tuple[BatchStore, BatchStore]
) -> None:
    """Alternate ``own`` (empty, its batch, its batch plus 50,000 foreign ids, part of
    it) over more than five claims, so the generic plan serves most of them."""
    a1, a2, a3 = keyed_rows(dsn, ["a", "a", "a"])
    first, second = stores
    assert [r.id for r in first.claim_batch(2)] == [a1, a2]
    first.prepare("obx:adv:1")
    b1, b2 = keyed_rows(dsn, ["b", "b"])
    foreign = list(range(10**9, 10**9 + 50_000))
    cases: list[tuple[list[int], list[int]]] = [
        ([], [b1, b2]),
        ([a1, a2], [a3, b1, b2]),
        ([a1, a2, *foreign], [a3, b1, b2]),
        ([a1], [b1, b2]),  # a2 is not its own: key a stays held
        ([a2], [b1, b2]),
        ([*foreign, a1], [b1, b2]),
    ]
    for _ in range(3):
        for own, expected in cases:
            assert [r.id for r in second.claim_batch(100, own=own)] == expected, own[:3]
            second.abandon_claim()
    first.finish("obx:adv:1", commit=True)
    assert [r.id for r in second.claim_batch(100, own=[])] == [a3, b1, b2]
    second.abandon_claim()


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("hold", ["block", "skip"])
def test_relays__tiny_batches_backlogs_beyond_the_window_and_dead_letters(
    settings: Settings, topology: Topology, batch: int, hold: str
) -> None:
    """Three relays, batches of 1 or 2 (a window of 5 or 10 keyed rows), a hot key
    whose backlog is many windows long at the front, 12 keys written in rounds, and
    one key with a dead letter (an exchange that does not exist) in its middle."""
    small = dataclasses.replace(
        settings, batch_size=batch, ordering_dead_letters=hold, publish_timeout=5.0
    )
    counters: dict[str, int] = {}
    committed = write_sequence(small.dsn, topology.exchange, [["hot"] * 40], counters)
    for _ in range(8):
        committed += write_sequence(
            small.dsn, topology.exchange, [[f"k{n}" for n in range(12)]], counters
        )
    with psycopg.connect(small.dsn) as conn:
        conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload, ordering_key) "
            "VALUES ('adv.no.such.exchange', 'k', 'dead:1', 'dead')"
        )
    dead_tail = write_sequence(small.dsn, topology.exchange, [["dead"] * 3], {"dead": 1})
    relays = [RelayProcess(small) for _ in range(3)]
    try:
        wait_for(lambda: rows_left(small.dsn) == 0, 120, "the relays to drain")
    finally:
        for relay in relays:
            relay.close()
    messages = topology.messages(idle=1.0)
    order, repeats = per_key(messages)
    assert repeats == 0
    assert prepared_left(small.dsn) == []
    with psycopg.connect(small.dsn) as conn:
        dead = conn.execute(
            "SELECT convert_from(payload, 'UTF8') FROM outbox_dead_letters ORDER BY id"
        ).fetchall()
    if hold == "block":
        assert [d[0] for d in dead] == ["dead:1", "dead:2", "dead:3", "dead:4"]
        assert "dead" not in order
    else:
        assert [d[0] for d in dead] == ["dead:1"]
        assert order.pop("dead") == [2, 3, 4]
        assert len(dead_tail) == 3
    assert_in_order(order, counters)
    assert sum(len(v) for v in order.values()) == len(committed)


# -- 2. jit = off ends with the claim's transaction -----------------------------------------
@pytest.mark.parametrize("pipeline", [True, False], ids=["pipeline", "no_pipeline"])
def test_jit_off__ends_with_the_claim_transaction(
    dsn: str, monkeypatch: pytest.MonkeyPatch, pipeline: bool
) -> None:
    if not pipeline:
        monkeypatch.setattr(psycopg.Pipeline, "is_supported", classmethod(lambda cls: False))
    keyed_rows(dsn, ["a", None, "b"])
    store = BatchStore(dsn, "outbox", statement_timeout=30)
    try:
        store.conn.execute("SET jit = on")
        store.conn.execute("SET plan_cache_mode = auto")

        def settings() -> tuple[Any, ...]:
            row = (
                store.conn.cursor(row_factory=tuple_row)
                .execute(
                    "SELECT current_setting('jit'), current_setting('plan_cache_mode'),"
                    " current_setting('enable_seqscan')"
                )
                .fetchone()
            )
            assert row is not None
            return tuple(row)

        for round_ in range(7):  # past the driver's prepare threshold
            rows = store.claim_batch(100)
            if round_ == 0:
                assert len(rows) == 3
                assert settings() == ("off", "force_generic_plan", "off")  # inside it
                store.prepare("obx:adv:jit")
                assert settings() == ("on", "auto", "on")  # PREPARE ended it
                store.record_dead_letters([DeadLetter(rows[0], "adv")], "obx:adv:jit")
                assert settings() == ("on", "auto", "on")
                assert store.finish("obx:adv:jit", commit=True)
            else:
                assert rows == []
                store.abandon_claim()
            assert settings() == ("on", "auto", "on")
    finally:
        store.close()


# -- 3. a resource alarm keeps the batch already published ----------------------------------
BATCH = 50


@pytest.fixture
def node_settings(settings: Settings, node_topology: Topology) -> Settings:
    return dataclasses.replace(
        settings,
        amqp_url=node_topology.amqp_url,
        ledger_queue=node_topology.ledger,
        batch_size=BATCH,
    )


class Running:
    def __init__(self, settings: Settings, *, blocked_timeout: float | None = None) -> None:
        self.relay = Relay(settings)
        if blocked_timeout is not None:  # pika's: max(2 x publish_timeout, 60 s)
            self.relay.publisher._nodes[0][0].blocked_connection_timeout = blocked_timeout
        self.relay.start()
        self.thread = threading.Thread(target=self.relay.run)
        self.thread.start()

    def stop(self, timeout: float = 90) -> None:
        self.relay.stop.set()
        self.thread.join(timeout=timeout)
        assert not self.thread.is_alive(), "the relay did not stop"

    def drain_and_stop(self, seconds: float = 90) -> None:
        try:
            dsn = self.relay.settings.dsn
            wait_for(lambda: rows_left(dsn) == 0 and not prepared_left(dsn), seconds, "drain")
        finally:
            self.stop()


def alarm(node: RabbitNode, on: bool) -> None:
    node.ctl("set_vm_memory_high_watermark", "0" if on else "0.4")


def keyed_load(settings: Settings, topology: Topology, counters: dict[str, int]) -> list[str]:
    return write_sequence(
        settings.dsn, topology.exchange, [[f"k{n}" for n in range(25)]] * 6, counters
    )


@contextlib.contextmanager
def blocked_with_keyed_rows(
    node: RabbitNode, running: Running, topology: Topology, counters: dict[str, int]
) -> Iterator[list[str]]:
    """Alarm on, keyed rows written, the relay's connection blocked; the alarm is
    cleared on leaving.  Yields the committed message ids, in commit order."""
    alarm(node, True)
    try:
        committed = keyed_load(running.relay.settings, topology, counters)
        wait_for(lambda: running.relay.publisher.blocked, 30, "blocked")
        yield committed
    finally:
        alarm(node, False)


@both_modes
def test_alarm__flapping_while_publishing_keyed_rows_costs_nothing(
    rabbit_node: RabbitNode, node_settings: Settings, node_topology: Topology
) -> None:
    s = dataclasses.replace(node_settings, publish_timeout=30.0)
    running = Running(s)
    counters: dict[str, int] = {}
    committed: list[str] = []
    try:
        for _ in range(6):
            committed += keyed_load(s, node_topology, counters)
            alarm(rabbit_node, True)
            time.sleep(0.3)
            alarm(rabbit_node, False)
            time.sleep(0.2)
        wait_for(lambda: rows_left(s.dsn) == 0 and not prepared_left(s.dsn), 90, "drain")
        wait_for(lambda: running.relay.stats.messages_published == len(committed), 30, "stats")
    finally:
        alarm(rabbit_node, False)
        running.stop()
    check_ordered(s.dsn, node_topology, committed, counters, bound=0)


@both_modes
def test_alarm__outlasting_the_publish_timeout_with_keyed_rows(
    rabbit_node: RabbitNode, node_settings: Settings, node_topology: Topology
) -> None:
    s = dataclasses.replace(node_settings, publish_timeout=2.0)
    running = Running(s)
    counters: dict[str, int] = {}
    with blocked_with_keyed_rows(rabbit_node, running, node_topology, counters) as committed:
        time.sleep(7)  # several publish timeouts
    running.drain_and_stop()
    check_ordered(s.dsn, node_topology, committed, counters, bound=in_flight(s) * BATCH)


@both_modes
def test_alarm__stopping_while_blocked_with_a_kept_batch_leaves_nothing_prepared(
    rabbit_node: RabbitNode, node_settings: Settings, node_topology: Topology
) -> None:
    s = dataclasses.replace(node_settings, publish_timeout=3.0)
    running = Running(s)
    counters: dict[str, int] = {}
    with blocked_with_keyed_rows(rabbit_node, running, node_topology, counters) as committed:
        time.sleep(1)
        started = time.monotonic()
        running.stop()
        stopped_in = time.monotonic() - started
        assert prepared_left(s.dsn) == [], "stopping left a prepared transaction"
        assert stopped_in < 4 * s.publish_timeout + 5, stopped_in
    Running(s).drain_and_stop()
    check_ordered(s.dsn, node_topology, committed, counters, bound=in_flight(s) * BATCH)


@both_modes
def test_alarm__plus_a_lost_database_session_while_a_batch_is_kept(
    rabbit_node: RabbitNode, node_settings: Settings, node_topology: Topology
) -> None:
    s = dataclasses.replace(node_settings, publish_timeout=20.0)
    running = Running(s)
    counters: dict[str, int] = {}
    with blocked_with_keyed_rows(rabbit_node, running, node_topology, counters) as committed:
        time.sleep(1)
        with psycopg.connect(s.dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND application_name LIKE 'outbox-relay%%'"
            )
        time.sleep(2)
    running.drain_and_stop()
    check_ordered(s.dsn, node_topology, committed, counters, bound=in_flight(s) * BATCH)


@both_modes
def test_alarm__outlasting_pikas_blocked_timeout_closes_the_connection_with_a_kept_batch(
    rabbit_node: RabbitNode, node_settings: Settings, node_topology: Topology
) -> None:
    """pika closes a connection blocked for longer than its blocked_connection_timeout
    (shortened to 3 s here); the relay reconnects and relays again once the alarm
    clears (it used to keep the old connection's "blocked" flag for good)."""
    s = dataclasses.replace(node_settings, publish_timeout=30.0)
    running = Running(s, blocked_timeout=3.0)
    counters: dict[str, int] = {}
    with blocked_with_keyed_rows(rabbit_node, running, node_topology, counters) as committed:
        time.sleep(8)
    running.drain_and_stop(120)
    check_ordered(s.dsn, node_topology, committed, counters, bound=in_flight(s) * BATCH)
