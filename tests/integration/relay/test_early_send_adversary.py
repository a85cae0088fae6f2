"""Adversary of the early send (28d608d): batch N+1 published beside N while N's
confirms are still due.  Real PostgreSQL and RabbitMQ; every test ends with the
promises (nothing lost, nothing unexpected, nothing prepared, duplicates bounded)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pika
import psycopg
import pytest

from outbox.config import Settings
from outbox.relay import batches as batches_module
from outbox.relay.process import Relay
from tests.fixtures.faults import (
    TcpProxy,
    arrived,
    check_delivery,
    crash_relay,
    drain,
    insert_rows,
    prepared_left,
    proxied_amqp_url,
    rows_left,
    wait_for,
)
from tests.fixtures.servers import Topology, run_cli, settings_env

BATCH = 10


def insert_many(dsn: str, rows: list[tuple[str, str, bytes, str | None]]) -> list[str]:
    """Insert rows in the given id order, one transaction; their message ids."""
    ids = []
    with psycopg.connect(dsn) as conn:
        for exchange, key, payload, ordering_key in rows:
            row = conn.execute(
                "INSERT INTO outbox (exchange, routing_key, payload, ordering_key) "
                "VALUES (%s, %s, %s, %s) RETURNING message_id",
                [exchange, key, payload, ordering_key],
            ).fetchone()
            assert row is not None
            ids.append(str(row[0]))
    return ids


@dataclasses.dataclass
class Spy:
    early: int = 0


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    """Counts the early sends the relay decides on (observation only)."""
    seen = Spy()
    original = batches_module.Batches._sends_early

    def sends_early(self: Any, batch: Any) -> bool:
        result = original(self, batch)
        if result and self.in_flight:
            seen.early += 1
        return result

    monkeypatch.setattr(batches_module.Batches, "_sends_early", sends_early)
    return seen


@pytest.fixture
def confirms_due(monkeypatch: pytest.MonkeyPatch) -> None:
    """N's confirms are taken as still due when the next step starts (as under a
    backlog), whatever the machine's speed: the next batch then goes out early.
    They are still awaited and taken as in production (``Publisher.confirmed``)."""
    monkeypatch.setattr(batches_module.Batches, "_confirms_in", lambda self, batch: False)


@contextlib.contextmanager
def running(settings: Settings) -> Iterator[Relay]:
    relay = Relay(settings)
    relay.start()
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    try:
        yield relay
    finally:
        relay.stop.set()
        thread.join(timeout=30)
        assert not thread.is_alive(), "relay did not stop"


def early_settings(settings: Settings, **changes: Any) -> Settings:
    return dataclasses.replace(settings, pipeline=True, batch_size=BATCH, **changes)


def test_nack_of_n_keeps_the_early_batch_finished_by_its_own_confirms(
    settings: Settings, topology: Topology, spy: Spy, confirms_due: None
) -> None:
    """Batch N: 9 good rows (big payloads; its confirms taken as still due at the
    next step, ``confirms_due``) then 1 row for a full reject-publish queue
    (nacked).  Batch N+1: 10 good rows published early beside N.  Promised
    (guarantee.md: "a nack on a live connection: the messages of that batch already
    accepted; a batch published beside it is finished by its own confirms"): only
    N's rows may be duplicated."""
    settings = early_settings(settings, backoff_initial=1.0, backoff_max=1.0)
    suffix = uuid.uuid4().hex[:8]
    full_ex, full_q, roomy_q = f"adv.full.{suffix}", f"adv.fullq.{suffix}", f"adv.roomy.{suffix}"
    ch = topology.channel()
    ch.confirm_delivery()
    ch.exchange_declare(full_ex, "fanout", auto_delete=False)
    ch.queue_declare(full_q, arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    ch.queue_bind(full_q, full_ex)
    ch.basic_publish(full_ex, "", b"fills the queue")
    big = b"x" * 200_000
    rows = [(topology.exchange, "n", big, None) for _ in range(9)]
    rows.append((full_ex, "n", b"nacked", None))
    rows += [(topology.exchange, "n1", big, None) for _ in range(10)]
    rows += [(topology.exchange, "rest", b"r", None) for _ in range(20)]
    ids = insert_many(settings.dsn, rows)
    batch_n, batch_n1 = set(ids[:10]), set(ids[10:20])

    try:
        with running(settings) as relay:
            wait_for(lambda: relay.stats.batches_rolled_back >= 1, 30, "the nack")
            # The cause goes away at once (the retry backs off 1 s first).
            ch.queue_declare(roomy_q)
            ch.queue_bind(roomy_q, full_ex)
            ch.queue_delete(full_q)
            wait_for(lambda: rows_left(settings.dsn) == 0, 30, "the drain")
            rolled_back = relay.stats.batches_rolled_back
        roomy = collections.Counter(arrivals(topology, roomy_q))
    finally:
        ch.queue_delete(roomy_q)
        ch.exchange_delete(full_ex)
        ch.connection.close()
    report = check_delivery(settings.dsn, topology, ids, max_duplicates=2 * BATCH, taken=roomy)
    assert spy.early >= 1, "the schedule never sent early: the test proves nothing"
    duplicated = {i for i, n in report.counts.items() if n > 1}
    assert all(n <= 2 for n in report.counts.values())
    assert duplicated <= batch_n, (
        f"rows of the early batch N+1 duplicated: {len(duplicated & batch_n1)} "
        f"(rolled back batches: {rolled_back}); promised: finished by its own confirms"
    )
    assert prepared_left(settings.dsn) == []


# -- a broker that stalls its replies (confirms) on a live connection -------------------------
class StallProxy(TcpProxy):
    """The faults proxy, whose server-to-client direction can be held for a while
    (the connection lives; confirms, and everything else, arrive late)."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(host, port)
        self.until = 0.0

    def stall(self, seconds: float) -> None:
        self.until = time.monotonic() + seconds

    def _downstream(self, pair: Any) -> None:
        with contextlib.suppress(OSError):
            while data := pair.server.recv(65536):
                while time.monotonic() < self.until:
                    time.sleep(0.005)
                pair.client.sendall(data)
        pair.cut()


@pytest.fixture
def stall_proxy(topology: Topology) -> Iterator[StallProxy]:
    params = pika.URLParameters(topology.amqp_url)
    proxy = StallProxy(params.host, params.port)
    yield proxy
    proxy.close()


def is_early(batches: Any, batch: Any) -> bool:
    """Whether ``batch`` is about to go out beside the one before it (still SENT)."""
    waiting = batches._waiting()
    return waiting is not None and waiting is not batch and waiting.state.name == "SENT"


def test_confirm_timeout_of_n_with_the_early_batch_out_stays_within_two_batches(
    settings: Settings,
    topology: Topology,
    stall_proxy: StallProxy,
    monkeypatch: pytest.MonkeyPatch,
    confirms_due: None,
) -> None:
    """The broker stalls every reply for 2 s (publish timeout 1 s) right after each of
    the first three early sends: each stall is one outage; the bound is 2 batches each."""
    settings = early_settings(
        settings,
        amqp_url=proxied_amqp_url(settings.amqp_url, stall_proxy),
        publish_timeout=1.0,
    )
    stalls = 3
    done = [0]
    original = batches_module.Batches._send

    def send(self: Any, batch: Any) -> None:
        early = is_early(self, batch)
        original(self, batch)
        if early and done[0] < stalls:
            done[0] += 1
            stall_proxy.stall(2.0)

    monkeypatch.setattr(batches_module.Batches, "_send", send)
    ids = insert_rows(settings.dsn, topology.exchange, 300)
    with running(settings) as relay:
        wait_for(lambda: rows_left(settings.dsn) == 0, 50, "the drain")
        stats = relay.stats
    assert done[0] == stalls, f"only {done[0]} stalls happened"
    report = check_delivery(settings.dsn, topology, ids, max_duplicates=stalls * 2 * BATCH)
    # Three separate outages: a row may be in flight in two of them (N+1 of one, N
    # of the next), never more than once per outage.
    assert max(report.counts.values()) <= stalls + 1
    print(f"timeouts: {stats.batches_rolled_back} rolled back, {report.duplicates} duplicates")


def test_broker_connection_cut_with_two_batches_out(
    settings: Settings,
    topology: Topology,
    amqp_proxy: TcpProxy,
    monkeypatch: pytest.MonkeyPatch,
    confirms_due: None,
) -> None:
    """The broker connection is cut right after N+1 went out beside N (three times)."""
    settings = early_settings(settings, amqp_url=proxied_amqp_url(settings.amqp_url, amqp_proxy))
    cuts = [0]

    def cut() -> None:
        cuts[0] += 1
        amqp_proxy.cut_all()

    original = batches_module.Batches._send

    def send(self: Any, batch: Any) -> None:
        early = is_early(self, batch)
        original(self, batch)
        if early and cuts[0] < 3 and self._seq % 7 == 0:
            cut()

    monkeypatch.setattr(batches_module.Batches, "_send", send)
    ids = insert_rows(settings.dsn, topology.exchange, 400)
    with running(settings):
        wait_for(lambda: rows_left(settings.dsn) == 0, 50, "the drain")
    assert cuts[0] >= 1, "no cut with two batches out: the test proves nothing"
    report = check_delivery(settings.dsn, topology, ids, max_duplicates=cuts[0] * 2 * BATCH)
    assert max(report.counts.values()) <= 2
    print(f"{cuts[0]} cuts: {report.duplicates} duplicates")


@pytest.mark.parametrize(
    "point",
    [
        # Also against a multi-database relay (``-m fleet_faults``).
        pytest.param("mid_publish:2", marks=pytest.mark.fleet_faults),
        "after_publish:1",
        "mid_publish:4",
    ],
)
def test_kill_9_with_two_batches_out(settings: Settings, topology: Topology, point: str) -> None:
    """kill -9 while N+1 is out beside N (its send, or N's confirms taken after it),
    twice in a row, then a clean drain: ≤ 2 batches of duplicates per crash."""
    settings = early_settings(settings)
    payload_rows = [(topology.exchange, "k", b"y" * 20_000, None) for _ in range(150)]
    ids = insert_many(settings.dsn, payload_rows)
    crashes = 2
    before: collections.Counter[str] = collections.Counter()
    for _ in range(crashes):
        crash_relay(settings, point)
        result = run_cli("resolve", env=settings_env(settings))
        assert result.returncode == 0, result.stderr
        assert prepared_left(settings.dsn) == []
        before += arrived(topology)
    drain(settings)
    report = check_delivery(
        settings.dsn, topology, ids, max_duplicates=crashes * 2 * BATCH, taken=before
    )
    assert max(report.counts.values()) <= crashes + 1
    print(f"{point}: {report.duplicates} duplicates after {crashes} crashes")


# -- a backlog of good and bad rows with ordering keys, several relays ----------------------------
def dead_letter_rows(dsn: str) -> dict[str, str]:
    with psycopg.connect(dsn) as conn:
        return {
            str(m): str(r)
            for m, r in conn.execute("SELECT message_id, reason FROM outbox_dead_letters")
        }


def arrivals(topology: Topology, queue: str | None = None) -> list[str]:
    """Message ids in the order the queue (``topology``'s by default) holds them."""
    if queue is not None:
        topology = dataclasses.replace(topology, queue=queue)
    return [str(props.message_id) for _, props, _ in topology.messages(idle=0.7)]


def test_mixed_backlog_three_relays_exchange_deleted_with_batches_out(
    settings: Settings, topology: Topology, spy: Spy, confirms_due: None
) -> None:
    """600 rows, batches of 10, three relays: plain rows, 8 ordering keys, a key whose
    3rd row is unroutable (the rest of it must follow into the dead letters), rows to a
    missing exchange, oversize rows, and rows to a second exchange that is deleted
    while the relays run (404 closes the channel with two batches out).  Every row ends
    delivered or a dead letter; keys in id order; nothing after a key's dead letter;
    duplicates only from the deletion (≤ 2 batches per relay).  A row of the deleted
    exchange may be both: its message accepted in a batch that the 404 then rolled
    back (a duplicate of that window), the row itself a dead letter at the retry, its
    exchange gone (docs/how-to/dead-letters.md); no other row may."""
    settings = early_settings(settings, max_message_bytes=50_000)
    suffix = uuid.uuid4().hex[:8]
    doomed_ex, doomed_q = f"adv.doomed.{suffix}", f"adv.doomedq.{suffix}"
    ch = topology.channel()
    ch.exchange_declare(doomed_ex, "fanout", durable=True)
    ch.queue_declare(doomed_q, durable=True)
    ch.queue_bind(doomed_q, doomed_ex)
    rows: list[tuple[str, str, bytes, str | None]] = []
    kinds: list[str] = []
    for i in range(600):
        if i % 37 == 5:
            rows.append((f"adv.missing.{suffix}", "k", b"m", None))
            kinds.append("missing")
        elif i % 41 == 7:
            rows.append((topology.exchange, "k", b"z" * 60_000, None))
            kinds.append("oversize")
        elif i % 5 == 0:
            rows.append((doomed_ex, "k", b"d", None))
            kinds.append("doomed")
        elif i % 3 == 0:
            key = f"key-{i % 8}"
            rows.append((topology.exchange, "k", f"{key}:{i}".encode(), key))
            kinds.append(key)
        elif i % 11 == 1:
            rows.append((topology.exchange, "k", b"dk", "dead-key"))
            kinds.append("dead-key")
        else:
            rows.append((topology.exchange, "k", b"p", None))
            kinds.append("plain")
    # The dead key's third row is unroutable (default exchange, no such queue).
    dead_key_rows = [i for i, k in enumerate(kinds) if k == "dead-key"]
    third = dead_key_rows[2]
    rows[third] = ("", f"nobody.{suffix}", b"unroutable", "dead-key")
    ids = insert_many(settings.dsn, rows)
    kind_of = dict(zip(ids, kinds, strict=True))
    order = {m: i for i, m in enumerate(ids)}

    relays = [Relay(settings) for _ in range(3)]
    threads = []
    deleted = False
    try:
        for relay in relays:
            relay.start()
            thread = threading.Thread(target=relay.run, daemon=True)
            thread.start()
            threads.append(thread)
        wait_for(lambda: spy.early >= 3, 20, "early sends")
        ch.exchange_delete(doomed_ex)
        deleted = True
        wait_for(lambda: rows_left(settings.dsn) == 0, 50, "the drain")
    finally:
        for relay in relays:
            relay.stop.set()
        for thread in threads:
            thread.join(timeout=30)
        if not deleted:
            ch.exchange_delete(doomed_ex)
    rolled_back = sum(r.stats.batches_rolled_back for r in relays)
    main = arrivals(topology)
    doomed = arrivals(topology, doomed_q)
    ch.queue_delete(doomed_q)
    ch.connection.close()
    letters = dead_letter_rows(settings.dsn)

    assert prepared_left(settings.dsn) == []
    assert rows_left(settings.dsn) == 0
    counts = collections.Counter(main) + collections.Counter(doomed)
    assert not set(counts) - set(ids), "messages nobody committed"
    both = set(counts) & set(letters)
    assert {kind_of[m] for m in both} <= {"doomed"}, "a row delivered and dead-lettered"
    neither = set(ids) - set(counts) - set(letters)
    assert not neither, f"{len(neither)} rows neither delivered nor dead letters"
    for m in ids:
        kind = kind_of[m]
        if kind in ("missing", "oversize"):
            assert m in letters, f"{kind} row delivered"
    assert ids[third] in letters
    later_dead_key = [m for m in ids if kind_of[m] == "dead-key" and order[m] > third]
    assert all(m in letters for m in later_dead_key), "a row went out behind its key's dead letter"
    for key in {k for k in kinds if k.startswith("key-") or k == "dead-key"}:
        seq = [order[m] for m in main if kind_of[m] == key]
        assert seq == sorted(seq), f"{key} out of id order: {seq}"
    # A delivered copy of a row that ended a dead letter is that window's duplicate too.
    duplicates = sum(n - 1 for n in counts.values()) + len(both)
    assert duplicates <= len(relays) * 2 * BATCH, f"{duplicates} duplicates"
    # No bound per message here: a refusal that closes the channel (the 404) makes
    # suspects of the batch's unconfirmed rows, and a good one accepted alone before
    # a later refusal goes out again (guarantee.md: "then those accepted before each
    # refusal of the culprit alone").
    print(
        f"mixed: {spy.early} early sends, {rolled_back} rollbacks, {duplicates} duplicates "
        f"({len(both)} delivered copies of rows that ended dead letters)"
    )


def test_dead_letter_write_failing_while_two_batches_out(
    settings: Settings, topology: Topology, spy: Spy, confirms_due: None
) -> None:
    """Every batch holds an unroutable row; the dead-letter write fails for 6 s from
    the moment the first early batch went out.  The retries must cost the batches in
    flight once (≤ 2 batches), no message more than twice."""
    from tests.integration.relay.test_failing_writes import INJECTOR

    settings = early_settings(settings, backoff_max=0.5)
    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        conn.execute(INJECTOR)
    suffix = uuid.uuid4().hex[:8]
    rows = [
        ("", f"nobody.{suffix}", b"u", None)
        if i % 10 == 9
        else (topology.exchange, "k", b"g", None)
        for i in range(200)
    ]
    ids = insert_many(settings.dsn, rows)
    bad = {ids[i] for i in range(200) if i % 10 == 9}
    good = [m for m in ids if m not in bad]

    started = threading.Event()
    original = batches_module.Batches._send
    switch = psycopg.connect(settings.dsn, autocommit=True)

    def send(self: Any, batch: Any) -> None:
        early = is_early(self, batch)
        if early and not started.is_set():
            # From now on the dead-letter write fails: N's returns, then N+1's.
            switch.execute("INSERT INTO test_faults VALUES ('dead_letters', '55P03')")
            started.set()
        original(self, batch)

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(batches_module.Batches, "_send", send)
    try:
        with running(settings) as relay:
            wait_for(started.is_set, 20, "an early send")
            time.sleep(6)
            switch.execute("DELETE FROM test_faults")
            wait_for(lambda: rows_left(settings.dsn) == 0, 40, "the drain")
            stats = relay.stats
    finally:
        monkeypatch.undo()
        switch.close()
    assert stats.write_failures["dead_letters"] >= 2, "the fault never hit"
    letters = dead_letter_rows(settings.dsn)
    assert set(letters) == bad
    report = check_delivery(settings.dsn, topology, good, max_duplicates=2 * BATCH)
    assert max(report.counts.values()) <= 2
    print(
        f"dead_letters failing: {report.duplicates} duplicates, "
        f"{stats.write_failures['dead_letters']} failures"
    )


# -- a resource alarm with two batches out (private node) -------------------------------------
@pytest.mark.parametrize(
    ("alarm_seconds", "publish_timeout", "bound"),
    [(1.0, 8.0, 0), (5.0, 1.5, 2 * BATCH)],
    ids=["clears-within-timeout", "outlives-timeout"],
)
def test_resource_alarm_right_after_an_early_send(
    settings: Settings,
    rabbit_node: Any,
    node_topology: Topology,
    alarm_seconds: float,
    publish_timeout: float,
    bound: int,
    confirms_due: None,
) -> None:
    """The node raises a memory alarm right after N+1 went out beside N.  Promised:
    0 duplicates if it clears within --publish-timeout, else ≤ 2 batches."""
    settings = early_settings(
        settings,
        amqp_url=node_topology.amqp_url,
        ledger_queue=node_topology.ledger,
        publish_timeout=publish_timeout,
    )
    raised = threading.Event()
    original = batches_module.Batches._send

    def send(self: Any, batch: Any) -> None:
        early = is_early(self, batch)
        original(self, batch)
        if early and self._seq >= 4 and not raised.is_set():
            rabbit_node.ctl("set_vm_memory_high_watermark", "0")
            raised.set()

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(batches_module.Batches, "_send", send)
    big = b"a" * 20_000
    ids = insert_many(settings.dsn, [(node_topology.exchange, "k", big, None)] * 120)
    try:
        with running(settings):
            wait_for(raised.is_set, 30, "an early send")
            time.sleep(alarm_seconds)
            rabbit_node.ctl("set_vm_memory_high_watermark", "0.4")
            wait_for(lambda: rows_left(settings.dsn) == 0, 45, "the drain")
    finally:
        monkeypatch.undo()
        rabbit_node.ctl("set_vm_memory_high_watermark", "0.4")
    report = check_delivery(settings.dsn, node_topology, ids, max_duplicates=bound)
    print(f"alarm {alarm_seconds}s, timeout {publish_timeout}s: {report.duplicates} duplicates")
