"""Per-key ordering against the real servers (docs/explanation/ordering.md).

The contract: rows sharing an ordering key reach the broker in id order; a row is
never published while an earlier row of its key is still in the outbox, whichever
relay holds it and whatever state its batch is in.  A single consumer of one queue,
dropping repeats by message_id, sees each key's messages in order with no gap.

- the states an earlier row of a key can be in when a later row is claimable:
  claimed by another relay, prepared, rolled back by the resolver, committed,
  dead-lettered (block and skip), and locked in the middle of a key;
- rows returned as unroutable inside a key, then released with
  ``dead-letters retry --ordering-key``;
- the issue's reproduction: keys written in sequence, three relays;
- chaos: writers committing several rows per key per transaction while relays are
  killed with -9 and replaced.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import random
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest

import outbox
from outbox.config import Settings
from outbox.db.batches import BatchStore
from tests.fixtures.faults import (
    RelayProcess,
    both_modes,
    chaos_run,
    in_flight,
    wait_for,
)
from tests.fixtures.servers import Topology, run_cli, settings_env
from tests.integration.relay.test_relay import prepared_left, relay_drain, remaining_rows


def write(dsn: str, rows: Sequence[tuple[str | None, str]], *, exchange: str) -> list[str]:
    """Commit ``(ordering_key, routing_key)`` rows in one transaction, in this order;
    their message ids.  The payload is the key and the row's position in its key."""
    ids = []
    with psycopg.connect(dsn) as conn:
        for key, routing_key in rows:
            ids.append(
                str(
                    outbox.enqueue(
                        conn,
                        exchange=exchange,
                        routing_key=routing_key,
                        payload=f"{key}".encode(),
                        ordering_key=key,
                    )
                )
            )
    return ids


def keyed_rows(dsn: str, specs: Sequence[str | None], exchange: str = "x") -> list[int]:
    """Commit one row per key in ``specs`` (one transaction); their row ids."""
    with psycopg.connect(dsn) as conn:
        return [
            conn.execute(
                "INSERT INTO outbox (exchange, routing_key, ordering_key) "
                "VALUES (%s, 'k', %s) RETURNING id",
                [exchange, key],
            ).fetchone()[0]  # type: ignore[index]
            for key in specs
        ]


def claimed(store: BatchStore, limit: int = 100, *, hold_keys: bool = True) -> list[int]:
    return [r.id for r in store.claim_batch(limit, hold_keys=hold_keys)]


# -- the states of a key's earlier row ---------------------------------------------------
def test_claim__a_key_claimed_by_another_relay_is_skipped_whole(
    dsn: str, stores: tuple[BatchStore, BatchStore]
) -> None:
    a1, free, _a2, b1 = keyed_rows(dsn, ["a", None, "a", "b"])
    first, second = stores
    assert claimed(first, 1) == [a1]  # a claim not yet prepared holds key a
    assert claimed(second) == [free, b1]  # not a2: its earlier row is held


def test_claim__a_key_prepared_by_another_relay_is_skipped_until_it_commits(
    dsn: str, stores: tuple[BatchStore, BatchStore]
) -> None:
    a1, a2, a3 = keyed_rows(dsn, ["a", "a", "a"])
    first, second = stores
    assert claimed(first, 2) == [a1, a2]  # a key's prefix: head and tail
    first.prepare("obx:test:1")
    assert claimed(second) == []
    second.abandon_claim()
    first.finish("obx:test:1", commit=True)
    assert claimed(second) == [a3]


def test_claim__the_next_batch_may_follow_the_relays_own_batch_in_flight(
    dsn: str, stores: tuple[BatchStore, BatchStore]
) -> None:
    a1, a2, a3 = keyed_rows(dsn, ["a", "a", "a"])
    first, second = stores
    assert claimed(first, 2) == [a1, a2]
    first.prepare("obx:test:3")
    # Another relay must wait for the commit; the relay that holds a1 and a2 may
    # claim a3 (and publishes it only after committing them).
    assert claimed(second) == []
    second.abandon_claim()
    assert [r.id for r in second.claim_batch(100, own=[a1, a2])] == [a3]
    second.abandon_claim()
    assert [r.id for r in second.claim_batch(100, own=[a1])] == []  # a2 is not its own


def test_claim__a_batch_rolled_back_by_the_resolver_puts_its_rows_back_in_front(
    dsn: str, stores: tuple[BatchStore, BatchStore]
) -> None:
    a1, a2, a3 = keyed_rows(dsn, ["a", "a", "a"])
    first, second = stores
    assert claimed(first, 1) == [a1]
    first.prepare("obx:test:2")
    first.close()  # the relay is gone; its batch is in doubt
    assert claimed(second) == []
    second.abandon_claim()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ROLLBACK PREPARED 'obx:test:2'")  # what the resolver decides
    assert claimed(second) == [a1, a2, a3]


def test_claim__a_gap_inside_a_key_stops_the_key_there(
    dsn: str, stores: tuple[BatchStore, BatchStore]
) -> None:
    a1, a2, _a3, b1 = keyed_rows(dsn, ["a", "a", "a", "b"])
    first, second = stores
    # Someone holds a2 alone (a claim that locked it and took nothing, say).
    second.conn.execute("BEGIN")
    second.conn.execute("SELECT 1 FROM outbox WHERE id = %s FOR UPDATE", [a2])
    assert claimed(first) == [a1, b1]  # never a3 ahead of a2


@pytest.mark.parametrize("mode", ["block", "skip"])
def test_claim__a_dead_letter_of_the_key_holds_its_later_rows_or_not(
    dsn: str, settings: Settings, topology: Topology, mode: str
) -> None:
    # Row 1 of key a is unroutable: a dead letter.  Rows 2-3 were written later.
    write(dsn, [("a", "k"), ("b", "k")], exchange=topology.exchange)
    write(dsn, [("a", f"nowhere.{uuid.uuid4().hex}")], exchange="")
    write(dsn, [("a", "k"), ("b", "k"), ("a", "k")], exchange=topology.exchange)
    relay_drain(dataclasses.replace(settings, ordering_dead_letters=mode))
    keys = [p.headers["x-ordering-key"] for _, p, _ in topology.messages()]
    with psycopg.connect(dsn) as conn:
        dead = conn.execute(
            "SELECT ordering_key, reason FROM outbox_dead_letters ORDER BY id"
        ).fetchall()
    if mode == "block":
        assert keys == ["a", "b", "b"]
        assert [k for k, _ in dead] == ["a", "a", "a"]
        assert "unroutable" in dead[0][1].lower() or "no route" in dead[0][1].lower()
        assert all("held back" in reason for _, reason in dead[1:])
    else:
        assert sorted(keys) == ["a", "a", "a", "b", "b"]
        assert [k for k, _ in dead] == ["a"]
    assert remaining_rows(dsn) == 0 and prepared_left(dsn) == []
    report = json.loads(run_cli("status", "--json", env=settings_env(settings)).stdout)
    assert report["dead_letter_ordering_keys"] == 1
    assert any("1 ordering keys have dead letters" in p for p in report["attention"])


def test_dead_letters__retry_by_key_brings_the_key_back_in_order(
    dsn: str, settings: Settings, topology: Topology
) -> None:
    """An unroutable row in the middle of a key (block): the rest of the key waits
    with it; once the route exists, retrying the key delivers all of it in order."""
    queue = f"test.late.{uuid.uuid4().hex[:8]}"
    rows = [("a", "k"), ("a", queue), ("a", "k"), ("b", "k"), ("a", "k")]
    ids = []
    for key, routing_key in rows:
        exchange = "" if routing_key == queue else topology.exchange
        ids += write(dsn, [(key, routing_key)], exchange=exchange)
    small = dataclasses.replace(settings, batch_size=3)
    relay_drain(small)
    first = [str(p.message_id) for _, p, _ in topology.messages()]
    assert first == [ids[0], ids[3]]  # a1 and b1; a2 returned, a3 and a4 held
    ch = topology.channel()
    ch.queue_declare(queue, durable=False, auto_delete=False)
    try:
        result = run_cli("dead-letters", "retry", "--ordering-key", "a", env=settings_env(small))
        assert "3 dead letters moved back" in result.stdout, result.stderr
        relay_drain(small)
        again = [str(p.message_id) for _, p, _ in topology.messages()]
        assert again == [ids[2], ids[4]]  # a3 then a4, after a2 below
        _method, props, _ = ch.basic_get(queue, auto_ack=True)
        assert props.message_id == ids[1] and props.headers["x-ordering-key"] == "a"
    finally:
        ch.queue_delete(queue)
        ch.connection.close()
    assert remaining_rows(dsn) == 0


# -- relays at work ---------------------------------------------------------------------
def per_key(messages: Sequence[tuple[object, Any, bytes]]) -> tuple[dict[str, list[int]], int]:
    """Each key's sequence numbers in arrival order, repeats (by message_id) dropped,
    as a single consumer sees them; and how many repeats there were."""
    seen: set[str] = set()
    order: dict[str, list[int]] = collections.defaultdict(list)
    repeats = 0
    for _, props, body in messages:
        if props.message_id in seen:
            repeats += 1
            continue
        seen.add(props.message_id)
        key, number = body.decode().split(":")
        assert props.headers["x-ordering-key"] == key
        order[key].append(int(number))
    return dict(order), repeats


def write_sequence(
    dsn: str, exchange: str, batches: Sequence[Sequence[str]], counters: dict[str, int]
) -> list[str]:
    """Commit each group of keys as one transaction; each row's payload is its key
    and its number within the key (counted in ``counters``)."""
    ids = []
    with psycopg.connect(dsn) as conn:
        for group in batches:
            with conn.transaction():
                for key in group:
                    number = counters[key] = counters.get(key, 0) + 1
                    ids.append(
                        str(
                            outbox.enqueue(
                                conn,
                                exchange=exchange,
                                routing_key="k",
                                payload=f"{key}:{number}".encode(),
                                ordering_key=key,
                            )
                        )
                    )
    return ids


def assert_in_order(order: dict[str, list[int]], counters: dict[str, int]) -> None:
    assert set(order) == set(counters)
    for key, numbers in order.items():
        assert numbers == list(range(1, counters[key] + 1)), f"key {key}: {numbers[:20]}…"


def test_relays__keys_written_in_sequence_arrive_in_order_with_three_relays(
    settings: Settings, topology: Topology
) -> None:
    """The issue's reproduction: keys written in sequence (rounds over 40 keys, so that
    a key's rows sit 40 ids apart and several relays hold rows of one key at once
    without the ordering rule), three relays."""
    small = dataclasses.replace(settings, batch_size=17)
    relays = [RelayProcess(small) for _ in range(3)]
    counters: dict[str, int] = {}
    committed: list[str] = []
    try:
        for _ in range(25):
            committed += write_sequence(
                small.dsn, topology.exchange, [[f"k{n}" for n in range(40)]], counters
            )
        wait_for(lambda: remaining_rows(small.dsn) == 0, 60, "the relays to drain")
    finally:
        for relay in relays:
            relay.close()
    order, repeats = per_key(topology.messages(idle=1.0))
    assert repeats == 0
    assert_in_order(order, counters)
    assert sum(len(v) for v in order.values()) == len(committed)


CHAOS_SECONDS = 15
RELAYS = 3
BATCH = 20


@both_modes
def test_chaos__killed_relays_never_reorder_a_key(settings: Settings, topology: Topology) -> None:
    chaos = dataclasses.replace(settings, batch_size=BATCH)
    counters: dict[str, int] = {}
    committed: list[str] = []
    stop_writing = threading.Event()
    keys = [f"order-{n}" for n in range(60)]

    def writer(seed: int) -> None:
        local = random.Random(seed)
        mine = keys[seed::2]  # each writer owns its keys: a key's rows commit in id order
        while not stop_writing.is_set():
            groups = [
                [
                    k
                    for k in local.sample(mine, local.randint(1, 6))
                    for _ in range(local.randint(1, 4))
                ]
            ]
            committed.extend(write_sequence(chaos.dsn, topology.exchange, groups, counters))
            time.sleep(0.01)

    writers = [threading.Thread(target=writer, args=(n,)) for n in range(2)]
    kills = chaos_run(chaos, writers, stop_writing, relays=RELAYS, seconds=CHAOS_SECONDS)
    assert prepared_left(chaos.dsn) == [] and remaining_rows(chaos.dsn) == 0
    messages = topology.messages(idle=1.0)
    order, repeats = per_key(messages)
    assert_in_order(order, counters)  # lost 0, nothing out of order, no gap
    assert {str(p.message_id) for _, p, _ in messages} == set(committed)
    bound = kills * in_flight(chaos) * BATCH
    assert repeats <= bound, f"{repeats} duplicates > bound {bound}"
