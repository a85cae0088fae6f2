"""Issue 18, item 6: the consumer's promise as a property, through live consumers.

Random mixes of hostile messages (NUL and invalid UTF-8 in ids and headers, bytes
headers, nested tables, no id, copies of a message) and handler behaviours (ok,
raise, BaseException, commit, rollback, close, a swallowed error, setting changes,
a session ended by the server, a statement that outlives a timeout) go through
two ``outbox consume`` processes, which are killed with ``-9`` at random moments
and started again.  Afterwards:

- every message with an id is in exactly one place: good ones have exactly one
  effect and are not parked, the others are parked once and have no effect,
  whatever number of copies was sent;
- a message without an id is parked and never applied (it has no id to tell its
  copies apart, so a kill between parking and the ack may park it again);
- the queue drains; no consumer ever exits except by our signals, and SIGTERM
  stops each with 0.

``OUTBOX_PROPERTY_EXAMPLES`` sets the number of examples (default 5, about 10 s
each); hypothesis prints the failing mix as generated (no shrinking).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import random
import time
import uuid
from pathlib import Path
from typing import Any

import pika
import psycopg
import pytest
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from psycopg import sql

from tests.fixtures.faults import wait_for
from tests.fixtures.servers import Topology
from tests.integration.inbox.support import Consumer, inbox_key

EXAMPLES = int(os.environ.get("OUTBOX_PROPERTY_EXAMPLES", "5"))

# Handler behaviours of support.HANDLERS: these apply (set_search_path leaves a
# session setting behind that breaks the consumer's next statement on that session)…
APPLYING = ["ok", "ok", "ok", "set_search_path"]
# …and every one of these fails.
FAILING = [
    "raise",
    "raise_nul",
    "exit",
    "interrupt",
    "fatal",
    "commit",
    "commit_more",
    "rollback",
    "close",
    "swallow",
    "row_factory",
    "autocommit",
    "read_only",
    "statement_timeout",
    "terminate",
    "own_connect",
    "sleep",
]
HEADERS: list[dict[str, Any] | None] = [
    None,
    {"tenant": "acme"},
    {"text": "NUL \x00 inside"},
    {"bin": b"\x00\xff"},
    {"nested": {"list": [b"\xff", "a\x00b", {"deep": 1}]}},
]


@dataclasses.dataclass(frozen=True)
class Sent:
    """One message of a mix: ``copies`` deliveries of the same id and body."""

    number: int
    message_id: bytes | None
    behaviour: str
    headers: dict[str, Any] | None
    copies: int

    @property
    def body(self) -> bytes:
        return f"{self.behaviour}:{self.number}".encode()


def ids() -> st.SearchStrategy[bytes | None]:
    return st.one_of(
        st.builds(lambda: uuid.uuid4().hex.encode()),
        st.builds(lambda: b"nul\x00" + uuid.uuid4().hex.encode()),
        st.builds(lambda: b"\xff\xfe" + uuid.uuid4().hex.encode()),
        st.builds(lambda: b"\\x" + uuid.uuid4().hex.encode()),
        st.builds(lambda: uuid.uuid4().hex.encode() * 8),  # 256 bytes: cut to 255 below
        st.none(),
    )


@st.composite
def mixes(draw: st.DrawFn) -> list[Sent]:
    count = draw(st.integers(8, 20))
    sent = []
    for number in range(count):
        message_id = draw(ids())
        if message_id is not None:
            message_id = message_id[:255]
        behaviour = draw(st.sampled_from(APPLYING + FAILING))
        copies = 1 if message_id is None else draw(st.integers(1, 2))
        sent.append(Sent(number, message_id, behaviour, draw(st.sampled_from(HEADERS)), copies))
    return sent


@pytest.fixture
def consumer_db(empty_dsn: str) -> str:
    return empty_dsn


def _publish(topology: Topology, queue: str, deliveries: list[Sent]) -> None:
    ch = topology.channel()
    ch.confirm_delivery()
    for message in deliveries:
        props = pika.BasicProperties(
            delivery_mode=2, message_id=message.message_id, headers=message.headers
        )
        ch.basic_publish("", queue, message.body, props)
    ch.connection.close()


def _ready(topology: Topology, queue: str) -> int:
    ch = topology.channel()
    count = int(ch.queue_declare(queue, passive=True).method.message_count)
    ch.connection.close()
    return count


def _rows(dsn: str, query: sql.Composable) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(query).fetchall()


PROPERTY_SETTINGS = hypothesis_settings(
    deadline=None,
    # No shrinking: each example runs live processes for seconds; the failing mix is
    # printed as generated.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
EXAMPLE = given(
    mix=mixes(),
    prefetch=st.sampled_from([1, 4, 10]),
    kills=st.lists(st.floats(0.1, 2.5), max_size=3),
    seed=st.integers(0, 2**32),
)


@hypothesis_settings(PROPERTY_SETTINGS, max_examples=EXAMPLES)
@EXAMPLE
def test_property__every_message_in_exactly_one_place_whatever_it_holds_and_does(
    topology: Topology,
    consumer_db: str,
    tmp_path: Path,
    mix: list[Sent],
    prefetch: int,
    kills: list[float],
    seed: int,
) -> None:
    check_property(topology, consumer_db, tmp_path, mix, prefetch, kills, seed, "act")


@hypothesis_settings(PROPERTY_SETTINGS, max_examples=max(1, EXAMPLES // 2))
@EXAMPLE
def test_property__the_same_with_an_async_def_handler(
    topology: Topology,
    consumer_db: str,
    tmp_path: Path,
    mix: list[Sent],
    prefetch: int,
    kills: list[float],
    seed: int,
) -> None:
    """Issue 31, item 5: ``support.act_async``, the same behaviours on the consumer's
    AsyncConnection, and ``cancel`` (the handler's task cancelled) among them."""
    mix = [dataclasses.replace(m, behaviour="cancel") if m.number == 0 else m for m in mix]
    check_property(topology, consumer_db, tmp_path, mix, prefetch, kills, seed, "act_async")


def check_property(
    topology: Topology,
    consumer_db: str,
    tmp_path: Path,
    mix: list[Sent],
    prefetch: int,
    kills: list[float],
    seed: int,
    function: str,
) -> None:
    print(f"seed {seed}, handler {function}")
    rng = random.Random(seed)
    run = uuid.uuid4().hex[:8]
    queue, inbox, effects = f"{topology.queue}.{run}", f"inbox_{run}", f"effects_{run}"
    ch = topology.channel()
    ch.queue_declare(queue, durable=True)
    ch.connection.close()
    with psycopg.connect(consumer_db) as conn:
        conn.execute(
            sql.SQL("CREATE TABLE {} (n bigserial, message_id text, body bytea)").format(
                sql.Identifier(effects)
            )
        )
    folder = tmp_path / run
    folder.mkdir()
    dsn = f"{consumer_db} options='-c idle_in_transaction_session_timeout=300'"
    per_queue = dataclasses.replace(topology, queue=queue)
    options: dict[str, Any] = {
        "function": function,
        "max_attempts": 2,
        "prefetch": prefetch,
        "env": {"OUTBOX_INBOX_TABLE": inbox, "EFFECTS_TABLE": effects, "HANDLER_SLEEP": "0.5"},
    }
    consumers = [Consumer(folder, dsn, per_queue, **options) for _ in range(2)]
    exits: list[str] = []
    try:
        for process in consumers:
            process.started()
        deliveries = [m for m in mix for _ in range(m.copies)]
        rng.shuffle(deliveries)
        _publish(topology, queue, deliveries)
        started = time.monotonic()
        for at in sorted(kills):
            time.sleep(max(0.0, started + at - time.monotonic()))
            victim = rng.randrange(len(consumers))
            for process in consumers:
                if not process.alive():
                    exits.append(process.output()[-3000:])
            consumers[victim].kill()
            consumers[victim].close()
            consumers[victim] = Consumer(folder, dsn, per_queue, **options)
        for process in consumers:
            process.started()

        bodies = {m.body for m in mix}

        def settled() -> bool:
            for process in consumers:
                assert process.alive(), f"a consumer exited:\n{process.output()[-4000:]}"
            applied = _rows(
                consumer_db, sql.SQL("SELECT DISTINCT body FROM {}").format(sql.Identifier(effects))
            )
            parked = _rows(
                consumer_db,
                sql.SQL("SELECT DISTINCT body FROM {}").format(sql.Identifier(f"{inbox}_parked")),
            )
            done = {bytes(r[0]) for r in applied} | {bytes(r[0]) for r in parked}
            return bodies <= done and _ready(topology, queue) == 0

        wait_for(settled, 90, "every message applied or parked")
        for process in consumers:
            assert process.alive(), f"a consumer exited:\n{process.output()[-4000:]}"
            code = process.terminate()
            assert code == 0, f"exit {code}:\n{process.output()[-4000:]}"
            process.close()
        # The queue drains: what the stopped consumers held goes to a last one.
        last = Consumer(folder, dsn, per_queue, **options).started()
        consumers = [last]
        wait_for(lambda: _ready(topology, queue) == 0, 30, "the queue to drain")
        time.sleep(1.0)  # and whatever it holds to be settled
        assert last.terminate() == 0, last.output()[-4000:]
        assert _ready(topology, queue) == 0
    finally:
        for process in consumers:
            process.close()
    assert not exits, f"a consumer exited before it was killed:\n{exits[0]}"

    applied = collections.Counter(
        bytes(r[0])
        for r in _rows(consumer_db, sql.SQL("SELECT body FROM {}").format(sql.Identifier(effects)))
    )
    parked = collections.Counter(
        bytes(r[0])
        for r in _rows(
            consumer_db, sql.SQL("SELECT body FROM {}").format(sql.Identifier(f"{inbox}_parked"))
        )
    )
    recorded = {
        r[0]
        for r in _rows(
            consumer_db, sql.SQL("SELECT message_id FROM {}").format(sql.Identifier(inbox))
        )
    }
    for message in mix:
        where = (message, applied[message.body], parked[message.body])
        if message.message_id is None:
            assert applied[message.body] == 0 and parked[message.body] >= 1, where
        elif message.behaviour in APPLYING:
            assert applied[message.body] == 1 and parked[message.body] == 0, where
            assert inbox_key(message.message_id) in recorded, where
        else:
            assert applied[message.body] == 0 and parked[message.body] == 1, where
            assert inbox_key(message.message_id) in recorded, where
    ch = topology.channel()
    ch.queue_delete(queue)
    ch.connection.close()
