"""The resolver against live relays, partitioned relays, other resolvers and other
applications' prepared transactions."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from outbox.amqp import ledger
from outbox.amqp.confirms import Outcome
from outbox.amqp.frames import Message
from outbox.amqp.publisher import Publisher
from outbox.config import Settings
from outbox.db.batches import BatchStore
from outbox.db.relays import ControlSession
from outbox.errors import DatabaseUnavailable, GidHeld
from outbox.gid import Gid, new_relay_id
from outbox.relay.process import Relay
from tests.fixtures.faults import (
    both_modes,
    check_delivery,
    drain,
    in_flight,
    insert_rows,
    prepared_left,
    wait_for,
)
from tests.fixtures.servers import Topology, run_cli, settings_env


@pytest.fixture
def publisher(settings: Settings) -> Iterator[Publisher]:
    """A connected publisher; the ledger stream is declared as a relay would."""
    pub = Publisher(settings.amqp_url)
    pub.connect()
    pub.declare_stream(settings.ledger_queue, settings.ledger_max_age)
    yield pub
    pub.close()


def prepare_batch(dsn: str, relay_id: str, seq: int, rows: int) -> tuple[str, list[str]]:
    """Claim and PREPARE a batch under ``relay_id``, as a relay would; returns gid, ids."""
    store = BatchStore(dsn, "outbox")
    try:
        claimed = store.claim_batch(rows)
        gid = str(Gid("outbox", relay_id, seq))
        store.prepare(gid)
    finally:
        store.close()
    return gid, [str(r.message_id) for r in claimed]


def resolve_json(settings: Settings, *extra: str) -> list[dict[str, object]]:
    result = run_cli("resolve", "--json", *extra, env=settings_env(settings))
    assert result.returncode == 0, result.stderr
    batches: list[dict[str, object]] = json.loads(result.stdout)["batches"]
    return batches


def lock_gone(dsn: str, relay_id: str) -> bool:
    store = BatchStore(dsn, "outbox")
    try:
        return not store.relay_liveness([relay_id])[relay_id].lock_held
    finally:
        store.close()


def test_resolver__waits_for_live_relay_then_rolls_back_once_its_session_ends(
    settings: Settings, topology: Topology, publisher: Publisher
) -> None:
    committed = insert_rows(settings.dsn, topology.exchange, 5)
    relay_id = new_relay_id()
    control = ControlSession(settings.dsn, "outbox", relay_id)
    assert control.acquire()
    gid, _ = prepare_batch(settings.dsn, relay_id, 1, 5)

    [waiting] = resolve_json(settings)
    assert (waiting["gid"], waiting["owner"], waiting["action"]) == (gid, "alive", "wait")
    assert waiting["outcome"] == "waiting"
    assert prepared_left(settings.dsn) == [gid]

    control.close()
    wait_for(lambda: lock_gone(settings.dsn, relay_id), 10, "the lock to be released")
    [resolved] = resolve_json(settings)
    assert (resolved["owner"], resolved["action"], resolved["outcome"]) == (
        "dead",
        "rollback",
        "rolled_back",
    )
    drain(settings)
    check_delivery(settings.dsn, topology, committed, max_duplicates=0)


def test_resolver__hand_over_lock_keeps_a_resolver_and_a_relay_taking_its_id_back_apart(
    settings: Settings, topology: Topology, publisher: Publisher
) -> None:
    committed = insert_rows(settings.dsn, topology.exchange, 5)
    relay_id = new_relay_id()
    control = ControlSession(settings.dsn, "outbox", relay_id)
    assert control.acquire()
    gid, _ = prepare_batch(settings.dsn, relay_id, 1, 5)
    control.close()  # its control session is gone; the process (say) lives on
    wait_for(lambda: lock_gone(settings.dsn, relay_id), 10, "the lock to be released")

    # The relay taking its id back holds the hand-over lock: no resolver acts.
    holder = BatchStore(settings.dsn, "outbox")
    try:
        assert holder.take_handover(relay_id)
        [held] = resolve_json(settings)
        assert (held["owner"], held["action"], held["outcome"]) == (
            "dead",
            "wait",
            "held_elsewhere",
        )
        assert prepared_left(settings.dsn) == [gid]
        # And while a resolver holds it, the relay cannot take its id back.
        blocked = ControlSession(settings.dsn, "outbox", relay_id)
        assert not blocked.reclaim()
        blocked.close()
        holder.release_handover(relay_id)
    finally:
        holder.close()

    back = ControlSession(settings.dsn, "outbox", relay_id)
    assert back.reclaim()
    [alive] = resolve_json(settings)
    assert (alive["owner"], alive["action"], alive["outcome"]) == ("alive", "wait", "waiting")
    back.close()  # gone for good this time (the server keeps running): dead at once
    wait_for(lambda: lock_gone(settings.dsn, relay_id), 10, "the lock to be released")
    [resolved] = resolve_json(settings)
    assert (resolved["owner"], resolved["outcome"]) == ("dead", "rolled_back")
    drain(settings)
    check_delivery(settings.dsn, topology, committed, max_duplicates=0)


def test_resolver__presumes_partitioned_relay_dead_after_relay_timeout(
    settings: Settings, topology: Topology, publisher: Publisher
) -> None:
    # relay_timeout 4 s: the first resolve (a process of its own) must run within
    # it after the last heartbeat, also on a loaded machine (2 s was not always).
    quick = dataclasses.replace(settings, relay_timeout=4.0, heartbeat_interval=0.5)
    committed = insert_rows(settings.dsn, topology.exchange, 5)
    relay_id = new_relay_id()
    control = ControlSession(settings.dsn, "outbox", relay_id)
    assert control.acquire()  # holds its lock, but never beats again: a partition
    gid, _ = prepare_batch(settings.dsn, relay_id, 1, 5)
    control.heartbeat()  # its last beat
    assert resolve_json(quick)[0]["action"] == "wait"

    time.sleep(quick.relay_timeout)  # the heartbeat must age past relay_timeout
    [resolved] = resolve_json(quick)

    assert (resolved["gid"], resolved["owner"], resolved["outcome"]) == (
        gid,
        "presumed_dead",
        "rolled_back",
    )
    with pytest.raises(DatabaseUnavailable):
        control.heartbeat()  # the resolver ended the partitioned relay's session
    control.close()
    drain(settings)
    check_delivery(settings.dsn, topology, committed, max_duplicates=0)


@both_modes
def test_relay__with_stale_heartbeat_rolls_back_instead_of_committing(
    settings: Settings, topology: Topology
) -> None:
    committed = insert_rows(settings.dsn, topology.exchange, 5)
    relay = Relay(settings)
    relay.start()
    try:
        # The control session cannot write its heartbeat (another session holds the
        # registry row), as when it is cut off: the heartbeat ages past the limit.
        with psycopg.connect(settings.dsn) as blocker:
            blocker.execute(
                "SELECT 1 FROM outbox_relays WHERE relay_id = %s FOR UPDATE", [relay.relay_id]
            )
            assert relay.liveness is not None
            wait_for(
                lambda: (
                    relay.liveness is not None
                    and relay.liveness.age > settings.relay_timeout - settings.heartbeat_interval
                ),
                3 * settings.relay_timeout,
                "the heartbeat to go stale",
            )
            with pytest.raises(DatabaseUnavailable, match="heartbeat is stale"):
                # Pipelined, the first step only publishes; the second records evidence.
                for _ in range(in_flight(settings)):
                    relay.batches.step()
            gid = str(Gid("outbox", relay.relay_id, relay.batches._seq))
    finally:
        relay.close()

    assert prepared_left(settings.dsn) == []
    recorded = ledger.finished_gids(settings.amqp_url, settings.ledger_queue, since=None)
    assert gid not in recorded, "no evidence may be written once presumed dead"
    drain(settings)
    check_delivery(settings.dsn, topology, committed, max_duplicates=5)


def test_resolver__two_resolvers_at_once_finish_each_batch_exactly_once(
    settings: Settings, topology: Topology, publisher: Publisher
) -> None:
    committed = insert_rows(settings.dsn, topology.exchange, 12)
    dead_relay = new_relay_id()
    batches = [prepare_batch(settings.dsn, dead_relay, seq, 1) for seq in range(1, 13)]
    evidence = {}
    for i, (gid, ids) in enumerate(batches):
        evidence[gid] = i % 2 == 0
        if evidence[gid]:  # publish the batch and its ledger record, then "crash"
            [d] = publisher.publish([Message(topology.exchange, "k", b"x", ids[0])], 10)
            record = ledger.record(
                gid, queue=settings.ledger_queue, rows=1, dead=0, relay_id=dead_relay
            )
            [r] = publisher.publish([record], 10)
            assert d.outcome is r.outcome is Outcome.ACCEPTED

    env = settings_env(settings)
    script = [sys.executable, "-m", "outbox", "resolve", "--json"]
    procs = [
        subprocess.Popen(script, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=60) for p in procs]

    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outputs]
    finishers: dict[str, list[str]] = {gid: [] for gid in evidence}
    for out, _ in outputs:
        for b in json.loads(out)["batches"]:
            # The loser of a race finds the gid gone, or held by the winner.
            lost_race = b["outcome"] in ("finished_elsewhere", "held_elsewhere")
            assert lost_race or b["outcome"] in ("committed", "rolled_back")
            if not lost_race:
                finishers[b["gid"]].append(b["outcome"])
    for gid, done in finishers.items():
        assert done == ["committed" if evidence[gid] else "rolled_back"], gid
    drain(settings)
    check_delivery(settings.dsn, topology, committed, max_duplicates=0)


def test_store__racing_finishers_one_wins_the_other_sees_finished_elsewhere(
    settings: Settings,
) -> None:
    """The loser sees the gid gone (False) or held by the winner (``GidHeld``):
    never finished twice, never reported finished while still held."""
    insert_rows(settings.dsn, "", 20)
    relay_id = new_relay_id()
    gids = [prepare_batch(settings.dsn, relay_id, seq, 1)[0] for seq in range(1, 21)]
    stores = [BatchStore(settings.dsn, "outbox") for _ in range(2)]
    try:
        for gid in gids:
            barrier = threading.Barrier(2)
            results: list[bool] = []

            def finish(
                store: BatchStore,
                commit: bool,
                gid: str = gid,
                barrier: threading.Barrier = barrier,
                results: list[bool] = results,
            ) -> None:
                barrier.wait()
                try:
                    results.append(store.finish(gid, commit=commit))
                except GidHeld:
                    results.append(False)

            threads = [
                threading.Thread(target=finish, args=(s, c))
                for s, c in zip(stores, (True, False), strict=True)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert sorted(results) == [False, True], gid
    finally:
        for s in stores:
            s.close()
    assert prepared_left(settings.dsn) == []


def _prepare_foreign(dsn: str, gid: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("BEGIN")
        conn.execute("CREATE TABLE IF NOT EXISTS app_orders (id int)")
        conn.execute("INSERT INTO app_orders VALUES (1)")
        conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))


def _rollback_prepared(dsn: str, gid: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))


def test_resolver__never_touches_foreign_prepared_transactions(
    settings: Settings, topology: Topology, publisher: Publisher, empty_dsn: str
) -> None:
    committed = insert_rows(settings.dsn, topology.exchange, 3)
    app_gid = "app:order:42"
    lookalike = str(Gid("outbox", new_relay_id(), 1))  # our format, another database
    ours, _ = prepare_batch(settings.dsn, new_relay_id(), 1, 3)
    _prepare_foreign(settings.dsn, app_gid)
    _prepare_foreign(empty_dsn, lookalike)
    try:
        results = {b["gid"]: b for b in resolve_json(settings)}
        status = run_cli("status", "--json", env=settings_env(settings))
        still_there = prepared_left(settings.dsn) + prepared_left(empty_dsn)
    finally:
        _rollback_prepared(settings.dsn, app_gid)
        _rollback_prepared(empty_dsn, lookalike)

    for gid in (app_gid, lookalike):
        assert (results[gid]["owner"], results[gid]["action"]) == ("foreign", "skip")
        assert results[gid]["outcome"] == "skipped"
    assert results[ours]["outcome"] == "rolled_back"
    assert sorted(still_there) == sorted([app_gid, lookalike])
    report = json.loads(status.stdout)
    assert {f["gid"] for f in report["foreign_prepared_transactions"]} >= {app_gid, lookalike}
    assert report["prepared_batches"] == []
    drain(settings)
    check_delivery(settings.dsn, topology, committed, max_duplicates=0)


def test_relay__resolves_dead_relays_batches_periodically(
    settings: Settings, topology: Topology
) -> None:
    committed = insert_rows(settings.dsn, topology.exchange, 5)
    # A batch left behind by a relay that died; the start-up pass is skipped, so
    # only a periodic pass (resolve_interval = 1 s) can release its rows.
    _, ids = prepare_batch(settings.dsn, new_relay_id(), 1, 5)
    assert len(ids) == 5
    relay = Relay(settings)
    relay.start()
    relay._next_resolve = time.monotonic() + settings.resolve_interval
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        wait_for(lambda: relay.stats.batches_resolved == 1, 30, "the periodic resolver pass")
        wait_for(lambda: relay.stats.messages_published == 5, 30, "the released rows")
    finally:
        relay.stop.set()
        thread.join(timeout=30)
    check_delivery(settings.dsn, topology, committed, max_duplicates=0)
