"""``outbox.testing``: a handler author's test against a real database, as the docs
page "Testing your handlers" shows it."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from outbox.amqp.message import InboxMessage
from outbox.testing import HandlerTester, make_message


@pytest.fixture
def orders_dsn(empty_dsn: str) -> str:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int, routing_key text)")
    return empty_dsn


def on_order(conn: Any, message: InboxMessage) -> None:
    order = message.json()
    if order.get("bad"):
        raise ValueError("order without a customer")
    conn.execute(
        "INSERT INTO orders (id, routing_key) VALUES (%s, %s)", [order["id"], message.routing_key]
    )


def orders(dsn: str) -> list[tuple[int, str]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT id, routing_key FROM orders ORDER BY id").fetchall()


def test_testing__a_handled_message_commits_its_effect_and_is_recorded(orders_dsn: str) -> None:
    with HandlerTester(orders_dsn, on_order) as tester:
        run = tester.run(make_message({"id": 7}, routing_key="order.created"))
        again = tester.run(make_message({"id": 7}, message_id=run.message_id))

    assert (run.outcome, run.recorded, run.attempts, run.error) == ("handled", True, 0, None)
    assert (again.outcome, again.recorded) == ("duplicate", True)
    assert orders(orders_dsn) == [(7, "order.created")]


def test_testing__a_failing_handler_counts_its_attempts_then_parks(orders_dsn: str) -> None:
    with HandlerTester(orders_dsn, on_order, max_attempts=2) as tester:
        message = make_message({"id": 8, "bad": True})
        first = tester.run(message)
        redelivered = make_message(
            {"id": 8, "bad": True}, message_id=message.message_id, redelivered=True
        )
        last = tester.run(redelivered)
        late_copy = tester.run(redelivered)

    assert (first.outcome, first.recorded, first.attempts) == ("retry", False, 1)
    assert first.error is not None and "order without a customer" in first.error
    assert (last.outcome, last.recorded, last.attempts) == ("parked", True, 0)
    assert last.error is not None and "order without a customer" in last.error
    assert late_copy.outcome == "duplicate"
    assert orders(orders_dsn) == []


def test_testing__a_handler_that_commits_fails_as_under_outbox_consume(orders_dsn: str) -> None:
    def commits(conn: Any, message: InboxMessage) -> None:
        on_order(conn, message)
        conn.commit()

    with HandlerTester(orders_dsn, commits) as tester:
        run = tester.run(make_message({"id": 9}))

    assert (run.outcome, run.recorded) == ("retry", False)
    assert orders(orders_dsn) == []
