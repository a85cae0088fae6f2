"""The relay's early ledger record (``Batches.step``: a batch whose confirms are in
is recorded before the next claim) followed at once by a failure of the database or
of the broker.  The early order is forced (the test makes the step wait for the confirms
before it looks), and the fault hits the claim that follows it."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import psycopg
import pytest

from outbox.config import Settings
from outbox.relay.batches import Batch, Batches, State
from outbox.relay.process import Relay
from tests.fixtures.faults import (
    TcpProxy,
    check_delivery,
    insert_rows,
    prepared_left,
    proxied_amqp_url,
    rows_left,
    wait_for,
)
from tests.fixtures.servers import Topology

BATCH = 10


def _record_every_batch_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make each step wait for the kept batch's confirms before it looks whether
    they are in, so that the batch is always recorded before the next claim."""
    confirms_in = Batches._confirms_in

    def confirms_in_after_waiting(self: Batches, batch: Batch) -> bool:
        self.broker.wait_for_confirms(self.settings.publish_timeout)
        return confirms_in(self, batch)

    monkeypatch.setattr(Batches, "_confirms_in", confirms_in_after_waiting)


def _fault_after_early_record(
    monkeypatch: pytest.MonkeyPatch, fault: Callable[[Batches], None]
) -> list[str]:
    """Record early every time; run ``fault`` once, at the first claim that follows a
    batch recorded early.  Returns the gids it hit."""
    _record_every_batch_early(monkeypatch)
    hit: list[str] = []
    claim = Batches._claim_and_prepare

    def claim_after_fault(self: Batches, waiting: Batch | None = None) -> Batch | None:
        if not hit and waiting is not None and waiting.state is State.RECORDED:
            hit.append(waiting.gid)
            fault(self)
        return claim(self, waiting)

    monkeypatch.setattr(Batches, "_claim_and_prepare", claim_after_fault)
    return hit


def _run(relay: Relay, done: Callable[[], bool]) -> None:
    relay.start()
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        wait_for(done, 20, "the relay to drain")
        assert thread.is_alive()
    finally:
        relay.stop.set()
        thread.join(timeout=30)
        assert not thread.is_alive()


def test_work_session_killed_right_after_the_early_record(
    settings: Settings, topology: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch recorded early survives the lost session (kept, RECORDED) and is
    committed from its evidence: 0 duplicates.  Catches a RECORDED batch put in
    doubt (rolled back: a batch of duplicates) or recorded twice."""
    settings = dataclasses.replace(settings, batch_size=BATCH, pipeline=True)

    def kill_work_session(batches: Batches) -> None:
        assert batches.store is not None and batches.store.backend is not None
        with psycopg.connect(settings.dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", [batches.store.backend.pid])

    hit = _fault_after_early_record(monkeypatch, kill_work_session)
    committed = insert_rows(settings.dsn, topology.exchange, 45)
    relay = Relay(settings)
    _run(relay, lambda: relay.stats.messages_published >= 45)
    assert hit, "no batch was recorded early"
    assert relay.stats.reconnects >= 1
    report = check_delivery(settings.dsn, topology, committed, max_duplicates=0)
    assert report.duplicates == 0


def test_broker_cut_right_after_the_early_record(
    settings: Settings, topology: Topology, amqp_proxy: TcpProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker connection goes between the early record and the next claim: the
    recorded batch's ledger confirm may be lost with it.  Nothing is lost, nothing is
    left prepared, and duplicates stay within the pipelined bound (2 batches)."""
    settings = dataclasses.replace(
        settings,
        batch_size=BATCH,
        pipeline=True,
        amqp_url=proxied_amqp_url(settings.amqp_url, amqp_proxy),
    )
    hit = _fault_after_early_record(monkeypatch, lambda _batches: amqp_proxy.cut_all())
    committed = insert_rows(settings.dsn, topology.exchange, 45)
    relay = Relay(settings)
    _run(relay, lambda: relay.stats.messages_published >= 45 and not relay.batches.in_flight)
    assert hit, "no batch was recorded early"
    check_delivery(settings.dsn, topology, committed, max_duplicates=2 * BATCH)


def test_ordering_keys_with_every_record_early(
    settings: Settings, topology: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of three keys, batches that follow the one recorded early: each key's
    messages arrive in row order, once."""
    settings = dataclasses.replace(settings, batch_size=BATCH, pipeline=True)
    _record_every_batch_early(monkeypatch)
    with psycopg.connect(settings.dsn) as conn:
        rows = conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload, ordering_key) "
            "SELECT %s, 'k', convert_to(i::text, 'UTF8'), 'key' || (i %% 3) "
            "FROM generate_series(1, 60) i RETURNING message_id",
            [topology.exchange],
        ).fetchall()
    committed = [str(r[0]) for r in rows]
    relay = Relay(settings)
    _run(relay, lambda: relay.stats.messages_published >= 60)
    messages = topology.messages()
    assert prepared_left(settings.dsn) == [] and rows_left(settings.dsn) == 0
    assert sorted(str(p.message_id) for _, p, _ in messages) == sorted(committed)
    seen: dict[str, list[int]] = {}
    for _, _, body in messages:
        number = int(body)
        seen.setdefault(f"key{number % 3}", []).append(number)
    assert all(numbers == sorted(numbers) for numbers in seen.values()), seen
