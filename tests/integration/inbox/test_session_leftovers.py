"""Issue 18: a failing message costs only itself, also when it failed on what an
earlier message's handler left in the session for good."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.servers import Topology
from tests.integration.inbox import support
from tests.integration.inbox.support import (
    consumer,
    effect_bodies,
    parked_bodies,
    publish,
    wait_settled,
)

LEAVES_STATE = r'''

def leaves_state(conn, message):
    """Each of these outlives the transaction, and fails if it is already there."""
    conn.execute("DECLARE held CURSOR WITH HOLD FOR SELECT 1")
    conn.execute("PREPARE mine AS SELECT 1")
    conn.execute("CREATE TEMP TABLE scratch (x int)")
    record(conn, message)
'''


def test_leftovers__a_message_failing_on_an_earlier_handlers_leftovers_is_retried_clean(
    topology: Topology, consumer_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A WITH HOLD cursor, a prepared statement, a temp table left by the first
    message made every later one fail on the same session until it was parked."""
    monkeypatch.setattr(support, "HANDLERS", support.HANDLERS + LEAVES_STATE)
    bodies = [f"m:{i}".encode() for i in range(3)]
    with consumer(
        tmp_path, consumer_dsn, topology, function="leaves_state", max_attempts=2, prefetch=1
    ):
        publish(topology, [(f"m-{i}", body) for i, body in enumerate(bodies)])
        wait_settled(consumer_dsn, topology, bodies, 30)
    assert parked_bodies(consumer_dsn) == []
    assert sorted(effect_bodies(consumer_dsn)) == bodies


LEAVES_STATE_ASYNC = r'''

async def leaves_state_async(conn, message):
    """``leaves_state`` as an async def handler on the consumer's AsyncConnection."""
    await conn.execute("DECLARE held CURSOR WITH HOLD FOR SELECT 1")
    await conn.execute("PREPARE mine AS SELECT 1")
    await conn.execute("CREATE TEMP TABLE scratch (x int)")
    await conn.execute(
        sql.SQL("INSERT INTO {} (message_id, body) VALUES (%s, %s)").format(EFFECTS),
        [message.message_id, message.body],
    )
'''


def test_leftovers__an_async_handlers_failing_message_is_retried_on_a_clean_session(
    topology: Topology, consumer_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above with an ``async def`` handler (``AsyncInboxStore``): the retry's new
    session is an ``AsyncConnection`` with the consumer's settings, and the message
    is applied, not parked."""
    monkeypatch.setattr(support, "HANDLERS", support.HANDLERS + LEAVES_STATE_ASYNC)
    bodies = [f"m:{i}".encode() for i in range(3)]
    with consumer(
        tmp_path,
        consumer_dsn,
        topology,
        function="leaves_state_async",
        max_attempts=2,
        prefetch=1,
    ):
        publish(topology, [(f"m-{i}", body) for i, body in enumerate(bodies)])
        wait_settled(consumer_dsn, topology, bodies, 30)
    assert parked_bodies(consumer_dsn) == []
    assert sorted(effect_bodies(consumer_dsn)) == bodies
