"""Bad-row triage with an in-memory broker (which exchanges exist) and a fake clock."""

import datetime
import uuid

from outbox.message import OutboxRow
from outbox.relay.batches import sort_out
from outbox.relay.triage import EXCHANGE_CACHE_SECONDS, Triage


class FakeBroker:
    def __init__(self, exchanges: set[str]) -> None:
        self.exchanges = exchanges
        self.checks: list[str] = []

    def exchange_exists(self, name: str) -> bool:
        self.checks.append(name)
        return name in self.exchanges


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def row(exchange: str, payload: bytes = b"x") -> OutboxRow:
    return OutboxRow(
        id=1,
        message_id=uuid.uuid4(),
        exchange=exchange,
        routing_key="k",
        payload=payload,
        headers=None,
        content_type=None,
        created_at=datetime.datetime.now(datetime.timezone.utc),
    )


def test_triage__missing_exchange_is_dead_and_others_pass() -> None:
    broker = FakeBroker({"orders"})
    triage = Triage(1024)
    dead, good = sort_out(triage, broker, [row("orders"), row("nope"), row("")])
    assert [r.exchange for r in good] == ["orders", ""]
    assert [(d.row.exchange, d.reason) for d in dead] == [
        ("nope", "exchange 'nope' does not exist")
    ]


def test_triage__trusts_a_verified_exchange_until_the_cache_expires() -> None:
    broker, clock = FakeBroker({"orders"}), Clock()
    triage = Triage(1024, clock)
    sort_out(triage, broker, [row("orders")])
    sort_out(triage, broker, [row("orders")])
    assert broker.checks == ["orders"]
    clock.now += EXCHANGE_CACHE_SECONDS + 1
    sort_out(triage, broker, [row("orders")])
    assert broker.checks == ["orders", "orders"]
    triage.forget_exchanges()
    sort_out(triage, broker, [row("orders")])
    assert len(broker.checks) == 3


def test_triage__a_learnt_refusal_dead_letters_that_exchange_for_a_while() -> None:
    clock = Clock()
    broker = FakeBroker({"audit.x", "orders"})
    triage = Triage(1024, clock)
    triage.learn(
        [
            "channel closed: 403 ACCESS_REFUSED - cannot publish to internal "
            "exchange 'audit.x' in vhost '/'"
        ]
    )
    dead, good = sort_out(triage, broker, [row("audit.x"), row("orders")])
    assert [d.row.exchange for d in dead] == ["audit.x"] and len(good) == 1
    clock.now += EXCHANGE_CACHE_SECONDS + 1
    dead, good = sort_out(triage, broker, [row("audit.x")])
    assert dead == [] and len(good) == 1


def test_triage__learns_the_brokers_real_message_size_limit() -> None:
    broker = FakeBroker(set())
    triage = Triage(10_000)
    triage.learn(
        [
            "channel closed: 406 PRECONDITION_FAILED - message size 5000 is larger "
            "than configured max size 4096",
            "connection lost: timed out",
        ]
    )
    assert triage.max_message_bytes == 4096
    dead, good = sort_out(triage, broker, [row("", b"x" * 5000), row("", b"x" * 10)])
    assert len(dead) == 1 and "5000 bytes" in dead[0].reason and len(good) == 1


def test_triage__suspects_are_isolated_and_a_convicted_one_is_dead() -> None:
    broker = FakeBroker({"orders"})
    triage = Triage(1024)
    rows = [row_with_id(i) for i in range(4)]
    reason = "channel closed: 406 PRECONDITION_FAILED - invalid message"
    for r in rows[1:3]:
        triage.suspects.refused(r.id, reason, alone=False)
    suspects, others = triage.isolate(rows)
    assert [r.id for r in suspects] == [1, 2] and [r.id for r in others] == [0, 3]

    triage.suspects.refused(2, reason, alone=True)
    triage.suspects.refused(2, reason, alone=True)
    dead, good = sort_out(triage, broker, rows)
    assert [d.row.id for d in dead] == [2] and "refused it 2 times" in dead[0].reason
    assert [r.id for r in good] == [0, 1, 3]


def row_with_id(row_id: int) -> OutboxRow:
    return OutboxRow(
        id=row_id,
        message_id=uuid.uuid4(),
        exchange="orders",
        routing_key="k",
        payload=b"x",
        headers=None,
        content_type=None,
        created_at=datetime.datetime.now(datetime.timezone.utc),
    )
