"""Adversarial tests of a batch's ids recorded ahead (``steps.record_ahead``): the
ids INSERT goes out in the pipeline with the handlers' statements, taken for new,
and the batch runs again ids first if that was not the whole story.

Real PostgreSQL (the consumer's own database) through ``Processor`` and the real
stores (``InboxStore``, ``aio.AsyncInboxStore`` on an application's loop); each
handler's behaviour is chosen by the message body.  The promise checked: one
committed effect per applied id (``effects`` has no unique constraint), a copy
of an applied message never gets a second one, only the culprit counts an
attempt, pipelining stays on unless a handler cannot run pipelined.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from psycopg import sql

from outbox.amqp.message import InboxMessage
from outbox.db.inbox import RECORD_LOCK_TIMEOUT, InboxStore
from outbox.inbox import aio
from outbox.inbox.planning import Disposition
from outbox.inbox.process import Inbox
from outbox.inbox.steps import AHEAD_PAUSE, Processor
from tests.fixtures.faults import wait_for
from tests.fixtures.servers import Topology
from tests.integration.inbox import support
from tests.integration.inbox.test_inbox import (
    INBOX,
    consumer_settings,
    new_ids,
)

INSERT = "INSERT INTO effects (message_id, body) VALUES (%s, %s)"
H, D, R, HELD = Disposition.HANDLED, Disposition.DUPLICATE, Disposition.RETRY, Disposition.HELD


# -- helpers --------------------------------------------------------------------------------
def msg(message_id: str, body: bytes = b"ok", queue: str = "q") -> InboxMessage:
    return InboxMessage(message_id, body, {}, "ex", "k", None, False, queue)


def effect_counts(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn) as conn:
        got = conn.execute(
            "SELECT message_id, count(*) FROM effects GROUP BY message_id"
        ).fetchall()
    return {str(m): int(n) for m, n in got}


def attempts(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn) as conn:
        got = conn.execute(f"SELECT message_id, attempts FROM {INBOX}_attempts").fetchall()
    return {str(m): int(n) for m, n in got}


def inbox_ids(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        return {str(r[0]) for r in conn.execute(f"SELECT message_id FROM {INBOX}").fetchall()}


def backend_pids(dsn: str) -> list[int]:
    with psycopg.connect(dsn) as conn:
        got = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'outbox-consume' "
            "AND datname = current_database()"
        ).fetchall()
    return [int(r[0]) for r in got]


def terminate_from_outside(dsn: str, pid: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", [pid])


class Calls:
    """How many times the handler was called per id."""

    def __init__(self) -> None:
        self.n: dict[str, int] = {}

    def add(self, message: InboxMessage) -> int:
        key = str(message.message_id)
        self.n[key] = self.n.get(key, 0) + 1
        return self.n[key]


def act(calls: Calls, dsn: str) -> Callable[[psycopg.Connection[Any], InboxMessage], None]:
    """A plain handler doing what the body says: ok, read (fetchone + rowcount),
    raise, divide (a statement's error), commit, commit_method, rollback, close,
    terminate (its own backend), kill_outside (its session ended by another
    session), swallow, sleep:<s>, raise_once."""

    def handler(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        n = calls.add(message)
        what = message.body.decode()
        if what == "read":
            cur = conn.execute("SELECT %s::text", [message.message_id])
            assert cur.fetchone() == (message.message_id,)
            cur = conn.execute(INSERT, [message.message_id, message.body])
            assert cur.rowcount == 1
            return
        conn.execute(INSERT, [message.message_id, message.body])
        if what == "ok":
            return
        if what == "raise":
            raise RuntimeError("the handler refuses")
        if what == "raise_once" and n == 1:
            raise RuntimeError("its first call fails")
        if what == "commit":
            conn.execute("COMMIT")
        elif what == "commit_method":
            conn.commit()
        elif what == "rollback":
            conn.rollback()
        elif what == "close":
            conn.close()
        elif what == "terminate":
            conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        elif what == "divide":  # pipelined, its error arrives with the sync
            conn.execute("SELECT 1/0")
        elif what == "kill_outside" and n == 1:
            pid = conn.pgconn.backend_pid
            terminate_from_outside(dsn, pid)
        elif what == "swallow":
            try:
                with conn.transaction():
                    conn.execute("SELECT 1/0")
            except psycopg.Error:
                pass
        elif what.startswith("sleep:"):
            time.sleep(float(what.split(":", 1)[1]))

    return handler


def processor(
    dsn: str,
    topology: Topology,
    handler: Callable[..., object],
    *,
    record_lock_timeout: float = RECORD_LOCK_TIMEOUT,
    max_attempts: int = 3,
) -> Processor:
    settings = consumer_settings(topology, dsn, max_attempts=max_attempts)
    store = InboxStore(dsn, INBOX, settings.consumer, record_lock_timeout=record_lock_timeout)
    store.ensure_schema()
    return Processor(store, handler, settings, Inbox(handler, settings).stats)


def run(p: Processor, batch: Sequence[InboxMessage]) -> list[Disposition]:
    return [o for o, _ in p.process_batch(batch)]


@contextlib.contextmanager
def closing(*ps: Processor) -> Iterator[None]:
    try:
        yield
    finally:
        for p in ps:
            p.store.close()


def apply_first(dsn: str, topology: Topology, ids: Sequence[str]) -> None:
    """Apply ``ids`` once (one effect each) so later copies are duplicates."""
    p = processor(dsn, topology, act(Calls(), dsn))
    with closing(p):
        assert run(p, [msg(i) for i in ids]) == [H] * len(ids)


# -- copies -----------------------------------------------------------------------------------
@pytest.mark.parametrize("body", ["ok", "read"])
def test_ahead__copies_inside_one_batch_at_first_and_last_position_apply_once(
    topology: Topology, consumer_dsn: str, body: str
) -> None:
    a, b, c = new_ids(3)
    calls = Calls()
    p = processor(consumer_dsn, topology, act(calls, consumer_dsn))
    with closing(p):
        got = run(p, [msg(a, body.encode()), msg(b, body.encode()), msg(c), msg(a), msg(a)])
        assert got == [H, H, H, D, D]
        # Copies within the batch are no reason to run it again: each handler once.
        assert calls.n == {a: 1, b: 1, c: 1}
        assert p.ahead_paused == 0
        assert p.pipelining
    assert effect_counts(consumer_dsn) == {a: 1, b: 1, c: 1}


@pytest.mark.parametrize("body", ["ok", "read"])
@pytest.mark.parametrize("where", ["first", "last", "both"])
def test_ahead__a_copy_of_an_applied_id_is_rolled_back_and_the_batch_runs_again(
    topology: Topology, consumer_dsn: str, body: str, where: str
) -> None:
    old, *fresh = new_ids(4)
    apply_first(consumer_dsn, topology, [old])
    calls = Calls()
    p = processor(consumer_dsn, topology, act(calls, consumer_dsn))
    batch = [msg(f, body.encode()) for f in fresh]
    expected = [H] * len(fresh)
    if where in ("first", "both"):
        batch.insert(0, msg(old, body.encode()))
        expected.insert(0, D)
    if where in ("last", "both"):
        batch.append(msg(old, body.encode()))
        expected.append(D)
    with closing(p):
        assert run(p, batch) == expected
        if body == "read":
            # The ids' INSERT failed on the copy (a unique violation), the first
            # handler's read meets that error and the run ahead stops there (or,
            # psycopg having read that error while the block's first statements
            # went out, no handler runs ahead at all); then ids first: the fresh
            # ones once more; nobody a third time.
            first = str(batch[0].message_id)
            assert calls.n.get(old, 0) <= (1 if first == old else 0)
            assert all(calls.n[f] == 1 or (f == first and calls.n[f] == 2) for f in fresh)
            assert set(calls.n) <= {old, *fresh}
        else:
            # Nothing read: every call runs ahead (the copy's once) and is rolled
            # back, unless the INSERT's error came back before a handler's statement
            # was sent (a slow client: psycopg takes the results that have arrived at
            # each statement), where the run ahead stops.  Then ids first: each fresh
            # one once more, the copy never; nobody a third time.
            assert calls.n.get(old, 0) <= 1
            assert all(calls.n[f] in (1, 2) for f in fresh)
            assert set(calls.n) <= {old, *fresh}
        assert p.ahead_paused == AHEAD_PAUSE
        assert p.pipelining
        assert p.stats.handler_failures == 0
    assert effect_counts(consumer_dsn) == {old: 1, **{f: 1 for f in fresh}}
    assert attempts(consumer_dsn) == {}


def test_ahead__the_pause_lasts_eight_pipelined_batches_then_ids_go_ahead_again(
    topology: Topology, consumer_dsn: str
) -> None:
    old = new_ids(1)[0]
    apply_first(consumer_dsn, topology, [old])
    calls = Calls()
    p = processor(consumer_dsn, topology, act(calls, consumer_dsn))
    with closing(p):
        assert run(p, [msg(old), *[msg(i) for i in new_ids(2)]]) == [D, H, H]
        paused = [p.ahead_paused]
        for _ in range(AHEAD_PAUSE + 1):
            assert run(p, [msg(i) for i in new_ids(2)]) == [H, H]
            paused.append(p.ahead_paused)
    assert paused == [8, 7, 6, 5, 4, 3, 2, 1, 0, 0]


# -- a handler that commits in a batch of copies only ---------------------------------------
@pytest.mark.parametrize("how", ["commit", "commit_method"])
def test_ahead__a_committing_handler_in_a_batch_of_applied_copies_commits_no_second_effect(
    topology: Topology, consumer_dsn: str, how: str
) -> None:
    """A relay's crash window republishes a whole batch: every id of it is applied
    already.  Recorded ahead, the INSERT inserts no row, so the guard trigger
    (which fails a COMMIT not run by the consumer) has nothing to fire on; a
    handler that runs COMMIT must still commit nothing (ids first, it is never
    even called for a copy)."""
    ids = new_ids(2)
    apply_first(consumer_dsn, topology, ids)
    calls = Calls()
    p = processor(consumer_dsn, topology, act(calls, consumer_dsn))
    with closing(p):
        got = run(p, [msg(ids[0], how.encode()), msg(ids[1])])
    assert got == [D, D]
    assert effect_counts(consumer_dsn) == {ids[0]: 1, ids[1]: 1}


@pytest.mark.parametrize("how", ["commit", "commit_method"])
def test_ahead__a_committing_handler_in_a_batch_with_a_new_id_commits_nothing(
    topology: Topology, consumer_dsn: str, how: str
) -> None:
    """The same with one new id in the batch: the guard fires on its row."""
    old, new = new_ids(2)
    apply_first(consumer_dsn, topology, [old])
    calls = Calls()
    p = processor(consumer_dsn, topology, act(calls, consumer_dsn))
    with closing(p):
        got = run(p, [msg(old, how.encode()), msg(new)])
    assert got == [D, H]
    assert effect_counts(consumer_dsn) == {old: 1, new: 1}
    assert attempts(consumer_dsn) == {}


# -- failures are the culprit's -------------------------------------------------------------
@pytest.mark.parametrize("bad", ["raise", "commit", "rollback", "close", "terminate", "sleep:1.3"])
@pytest.mark.parametrize("position", [0, 2])
def test_ahead__a_failing_handler_in_a_batch_recorded_ahead_counts_only_its_attempt(
    topology: Topology, consumer_dsn: str, bad: str, position: int
) -> None:
    if bad.startswith("sleep"):
        with psycopg.connect(consumer_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("ALTER DATABASE {} SET idle_in_transaction_session_timeout = '1s'").format(
                    sql.Identifier(str(conn.info.dbname))
                )
            )
    ids = new_ids(3)
    calls = Calls()
    p = processor(consumer_dsn, topology, act(calls, consumer_dsn))
    batch = [msg(i) for i in ids]
    batch[position] = msg(ids[position], bad.encode())
    expected = [H, H, H]
    expected[position] = R
    with closing(p):
        assert run(p, batch) == expected
        assert p.pipelining, bad
        assert p.stats.handler_failures == 1
    good = [i for k, i in enumerate(ids) if k != position]
    assert effect_counts(consumer_dsn) == {i: 1 for i in good}
    assert attempts(consumer_dsn) == {ids[position]: 1}
    assert inbox_ids(consumer_dsn) == set(good)


def test_ahead__a_handler_catching_an_error_at_once_applies_all_and_keeps_pipelining_on(
    topology: Topology, consumer_dsn: str
) -> None:
    """A savepoint around a failing statement (psycopg syncs at its end): every
    message applied once, nothing counted."""
    ids = new_ids(3)
    p = processor(consumer_dsn, topology, act(Calls(), consumer_dsn))
    with closing(p):
        assert run(p, [msg(ids[0]), msg(ids[1], b"swallow"), msg(ids[2])]) == [H, H, H]
        assert p.pipelining  # conn.transaction() syncs in pipeline mode: it can run so
    assert effect_counts(consumer_dsn) == {i: 1 for i in ids}
    assert attempts(consumer_dsn) == {}


@pytest.mark.parametrize("body", [b"raise_once", b"kill_outside"])
def test_ahead__a_failure_gone_on_the_rerun_costs_nobody_an_attempt(
    topology: Topology, consumer_dsn: str, body: bytes
) -> None:
    """A handler that fails only on its first call, or the session killed from
    outside mid batch: the batch runs again and applies all; nothing is counted and
    pipelining stays on."""
    ids = new_ids(4)
    p = processor(consumer_dsn, topology, act(Calls(), consumer_dsn))
    with closing(p):
        got = run(p, [msg(ids[0]), msg(ids[1], body), msg(ids[2]), msg(ids[3])])
        assert got == [H] * 4
        assert p.pipelining and p.stats.handler_failures == 0
    assert effect_counts(consumer_dsn) == {i: 1 for i in ids}
    assert attempts(consumer_dsn) == {}


# -- two consumers, copies at the same moment -----------------------------------------------
@pytest.mark.parametrize("outcome", ["commits", "fails", "outlives_lock_timeout"])
def test_ahead__two_consumers_with_copies_of_one_id_at_the_same_moment(
    topology: Topology, consumer_dsn: str, outcome: str
) -> None:
    """A holds id X uncommitted inside its handler; B's batch [X, Y] records its ids
    ahead and its INSERT waits on A's row.  A commits: X is B's duplicate; A fails:
    B applies X; A holds past B's record lock_timeout: X is set aside (HELD) uncounted and
    Y is applied; nobody turns pipelining off."""
    x, y, z = new_ids(3)
    in_handler, release = threading.Event(), threading.Event()
    calls = Calls()

    def held(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        calls.add(message)
        conn.execute(INSERT, [message.message_id, b"A"])
        if message.message_id == x:
            # Pipelined, the batch's ids may still be on their way to the server:
            # a result read waits for them, so X's row is A's before B starts (a
            # CI rehearsal saw B's INSERT get there first).
            assert conn.execute("SELECT 1").fetchone() == (1,)
            in_handler.set()
            assert release.wait(20)
            if outcome == "fails":
                raise RuntimeError("A fails")

    a = processor(consumer_dsn, topology, held)
    b = processor(
        consumer_dsn,
        topology,
        act(calls, consumer_dsn),
        # Long enough here for B's INSERT to wait for A's outcome.
        record_lock_timeout=0.5 if outcome == "outlives_lock_timeout" else 10.0,
    )
    results: dict[str, list[Disposition]] = {}

    def run_a() -> None:
        results["a"] = run(a, [msg(z), msg(x)])

    def run_b() -> None:
        results["b"] = run(b, [msg(x, b"read"), msg(y)])

    with closing(a, b):
        ta = threading.Thread(target=run_a)
        ta.start()
        assert in_handler.wait(10)
        tb = threading.Thread(target=run_b)
        tb.start()
        if outcome == "outlives_lock_timeout":
            tb.join(30)  # A holds X until B is done, however slow the machine
        else:
            time.sleep(1.5)
        release.set()
        ta.join(30)
        tb.join(30)
        assert not ta.is_alive() and not tb.is_alive()
        assert a.pipelining and b.pipelining
    counts = effect_counts(consumer_dsn)
    if outcome == "commits":
        assert results == {"a": [H, H], "b": [D, H]}
        assert counts == {x: 1, y: 1, z: 1}
        assert attempts(consumer_dsn) == {}
    elif outcome == "fails":
        # A's replay of X comes after B applied it (a copy: skipped, nothing
        # counted) or before (its failure counted once); never applied by both.
        assert results["a"] in ([H, R], [H, D])
        assert results["b"] == [H, H]
        assert counts == {x: 1, y: 1, z: 1}
        assert attempts(consumer_dsn) == ({x: 1} if results["a"][1] is R else {})
    else:
        assert results == {"a": [H, H], "b": [HELD, H]}
        assert counts == {x: 1, y: 1, z: 1}
        assert attempts(consumer_dsn) == {}


# -- async def handlers -----------------------------------------------------------------------
class Loop:
    """An application's event loop on a thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def app_loop() -> Iterator[Loop]:
    loop = Loop()
    yield loop
    loop.close()


def act_async(calls: Calls, dsn: str) -> Callable[..., Any]:
    async def handler(conn: psycopg.AsyncConnection[Any], message: InboxMessage) -> None:
        n = calls.add(message)
        what = message.body.decode()
        if what == "read":
            cur = await conn.execute("SELECT %s::text", [message.message_id])
            assert await cur.fetchone() == (message.message_id,)
            await conn.execute(INSERT, [message.message_id, message.body])
            return
        await conn.execute(INSERT, [message.message_id, message.body])
        if what == "ok":
            return
        if what == "raise":
            raise RuntimeError("the handler refuses")
        if what == "commit":
            await conn.execute("COMMIT")
        elif what == "commit_method":
            await conn.commit()
        elif what == "rollback":
            await conn.rollback()
        elif what == "close":
            await conn.close()
        elif what == "terminate":
            await conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        elif what == "divide":  # its error arrives with the pipeline's sync
            await conn.execute("SELECT 1/0")
        elif what == "orphan":  # refused only by the COMMIT
            await conn.execute("INSERT INTO children VALUES (42)")
        elif what == "kill_outside" and n == 1:
            await asyncio.to_thread(terminate_from_outside, dsn, conn.pgconn.backend_pid)
        elif what.startswith("sleep:"):
            await asyncio.sleep(float(what.split(":", 1)[1]))

    return handler


def async_processor(
    dsn: str, topology: Topology, handler: Any, loop: Loop, *, max_attempts: int = 3
) -> Processor:
    settings = consumer_settings(topology, dsn, max_attempts=max_attempts)
    bridge, ahead = aio.Bridge(loop.loop), aio.Ahead()
    store = aio.AsyncInboxStore(settings, bridge, ahead)
    store.ensure_schema()
    face = aio.AwaitedHandler(handler, bridge, ahead)
    return Processor(store, face, settings, Inbox(face, settings).stats)


@pytest.mark.parametrize("how", ["commit", "commit_method"])
def test_ahead_async__a_committing_handler_in_a_batch_of_applied_copies_commits_no_second_effect(
    topology: Topology, consumer_dsn: str, app_loop: Loop, how: str
) -> None:
    ids = new_ids(2)
    apply_first(consumer_dsn, topology, ids)
    p = async_processor(consumer_dsn, topology, act_async(Calls(), consumer_dsn), app_loop)
    with closing(p):
        got = run(p, [msg(ids[0], how.encode()), msg(ids[1])])
    assert got == [D, D]
    assert effect_counts(consumer_dsn) == {ids[0]: 1, ids[1]: 1}


@pytest.mark.parametrize("body", ["ok", "read"])
def test_ahead_async__a_copy_of_an_applied_id_first_and_last_applies_once(
    topology: Topology, consumer_dsn: str, app_loop: Loop, body: str
) -> None:
    old, *fresh = new_ids(3)
    apply_first(consumer_dsn, topology, [old])
    calls = Calls()
    p = async_processor(consumer_dsn, topology, act_async(calls, consumer_dsn), app_loop)
    batch = [msg(old, body.encode()), *[msg(f, body.encode()) for f in fresh], msg(old)]
    with closing(p):
        assert run(p, batch) == [D, H, H, D]
        assert p.pipelining and p.stats.handler_failures == 0
        assert p.ahead_paused == AHEAD_PAUSE
    assert effect_counts(consumer_dsn) == {old: 1, **{f: 1 for f in fresh}}
    assert attempts(consumer_dsn) == {}


def test_ahead_async__a_batch_of_reading_handlers_is_recorded_ahead_once(
    topology: Topology, consumer_dsn: str, app_loop: Loop
) -> None:
    ids = new_ids(3)
    calls = Calls()
    p = async_processor(consumer_dsn, topology, act_async(calls, consumer_dsn), app_loop)
    with closing(p):
        assert run(p, [msg(i, b"read") for i in ids]) == [H, H, H]
        assert calls.n == {i: 1 for i in ids}  # not run again ids first
        assert p.ahead_paused == 0 and p.pipelining
    assert effect_counts(consumer_dsn) == {i: 1 for i in ids}


@pytest.mark.parametrize(
    "bad", ["raise", "commit", "rollback", "close", "terminate", "divide", "orphan"]
)
def test_ahead_async__a_failing_handler_counts_only_its_attempt(
    topology: Topology, consumer_dsn: str, app_loop: Loop, bad: str
) -> None:
    """The pipeline block of a batch of async handlers ends in the COMMIT's hop, so
    a statement's error that arrives with the sync (divide) or a COMMIT refused by a
    deferred constraint (orphan) fails the batch there, as a failure seen in the
    handler's own time does: applied again one by one, only the bad message fails,
    and the next batch goes through."""
    with psycopg.connect(consumer_dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS parents (id int PRIMARY KEY);"
            "CREATE TABLE IF NOT EXISTS children "
            "(parent int REFERENCES parents DEFERRABLE INITIALLY DEFERRED)"
        )
    ids, more = new_ids(3), new_ids(3)
    calls = Calls()
    p = async_processor(consumer_dsn, topology, act_async(calls, consumer_dsn), app_loop)
    with closing(p):
        got = run(p, [msg(ids[0]), msg(ids[1], bad.encode()), msg(ids[2])])
        assert got == [H, R, H]
        assert p.pipelining and p.stats.handler_failures == 1
        assert run(p, [msg(i) for i in more]) == [H, H, H]
    assert effect_counts(consumer_dsn) == {i: 1 for i in [ids[0], ids[2], *more]}
    assert attempts(consumer_dsn) == {ids[1]: 1}
    # In the batch with its ids ahead, again with them first, then alone; a refused
    # COMMIT is no handler's own failure: the batch is not run again ids first.
    assert calls.n[ids[1]] == (2 if bad == "orphan" else 3)


def test_ahead_async__a_batch_of_first_deliveries_costs_two_hops(
    topology: Topology, consumer_dsn: str, app_loop: Loop
) -> None:
    """The handlers run ahead in one hop; the pipeline's end, the checks and the
    COMMIT in a second, whatever the batch's size (three before 0.6.0's change)."""
    p = async_processor(consumer_dsn, topology, act_async(Calls(), consumer_dsn), app_loop)
    store = p.store
    assert isinstance(store, aio.AsyncInboxStore)
    bridge = store._bridge
    hops = 0
    real = bridge.run

    def counted(coro: Any) -> Any:
        nonlocal hops
        hops += 1
        return real(coro)

    with closing(p):
        run(p, [msg(i) for i in new_ids(3)])  # warm: the first batch may record ids first
        for size in (2, 50):
            hops = 0
            bridge.run = counted  # type: ignore[method-assign]
            try:
                assert run(p, [msg(i) for i in new_ids(size)]) == [H] * size
            finally:
                bridge.run = real  # type: ignore[method-assign]
            assert hops == 2, (size, hops)


def test_ahead_async__the_session_killed_from_outside_mid_batch_costs_nobody_an_attempt(
    topology: Topology, consumer_dsn: str, app_loop: Loop
) -> None:
    ids = new_ids(3)
    p = async_processor(consumer_dsn, topology, act_async(Calls(), consumer_dsn), app_loop)
    with closing(p):
        got = run(p, [msg(ids[0]), msg(ids[1], b"kill_outside"), msg(ids[2])])
        assert got == [H, H, H]
        assert p.pipelining and p.stats.handler_failures == 0
    assert effect_counts(consumer_dsn) == {i: 1 for i in ids}
    assert attempts(consumer_dsn) == {}


def test_ahead_async__the_session_killed_while_idle_before_a_batch(
    topology: Topology, consumer_dsn: str, app_loop: Loop
) -> None:
    """The hop that enters pipeline mode and sends the ids meets a dead session: an
    outage for the batch (nothing applied, nothing counted); the next batch goes."""
    ids = new_ids(4)
    p = async_processor(consumer_dsn, topology, act_async(Calls(), consumer_dsn), app_loop)
    with closing(p):
        for pid in backend_pids(consumer_dsn):
            terminate_from_outside(consumer_dsn, pid)
        time.sleep(0.2)
        with contextlib.suppress(Exception):
            run(p, [msg(ids[0]), msg(ids[1])])
        if p.store.broken:
            p.store.reconnect()
        assert run(p, [msg(ids[0]), msg(ids[1])]) == [H, H]
        assert run(p, [msg(ids[2]), msg(ids[3])]) == [H, H]
        assert p.pipelining
    assert effect_counts(consumer_dsn) == {i: 1 for i in ids}
    assert attempts(consumer_dsn) == {}


# -- a property: copies, failures and kills mixed ---------------------------------------------
BEHAVIOURS = [
    "ok",
    "ok",
    "read",
    "raise",
    "divide",
    "rollback",
    "close",
    "terminate",
    "kill_outside",
]


PROPERTY = hypothesis_settings(
    max_examples=int(os.environ.get("OUTBOX_AHEAD_EXAMPLES", "12")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
BATCHES = st.lists(
    st.lists(st.tuples(st.integers(0, 7), st.sampled_from(BEHAVIOURS)), min_size=2, max_size=6),
    min_size=1,
    max_size=4,
)


@PROPERTY
@given(batches=BATCHES)
def test_ahead__property_copies_failures_and_kills(
    topology: Topology, consumer_dsn: str, batches: list[list[tuple[int, str]]]
) -> None:
    """Ids drawn from a small pool (copies across and inside batches); each id keeps
    one behaviour (its first).  A good id has one effect and no attempt, its copies
    are duplicates; a bad one has no effect and one attempt per delivery of it
    (copies included); pipelining stays on."""
    p = processor(consumer_dsn, topology, act(Calls(), consumer_dsn), max_attempts=100)
    copies_failures_and_kills(p, consumer_dsn, batches)


@PROPERTY
@given(batches=BATCHES)
def test_ahead_async__property_copies_failures_and_kills(
    topology: Topology, consumer_dsn: str, app_loop: Loop, batches: list[list[tuple[int, str]]]
) -> None:
    """The same with ``async def`` handlers, whose batches run ahead on the loop and
    end their pipeline in the COMMIT's round trip."""
    handler = act_async(Calls(), consumer_dsn)
    p = async_processor(consumer_dsn, topology, handler, app_loop, max_attempts=100)
    copies_failures_and_kills(p, consumer_dsn, batches)


def copies_failures_and_kills(
    p: Processor,
    consumer_dsn: str,
    batches: list[list[tuple[int, str]]],
    *,
    failing: Collection[str] = ("raise", "divide", "rollback", "close", "terminate"),
    killed_alone: str = "kill_outside",
    before_batch: Callable[[int], None] | None = None,
) -> None:
    """The property's checks over ``batches`` of (pool index, behaviour): a
    behaviour in ``failing`` fails each delivery (one attempt each), the
    ``killed_alone`` one may fail once where it runs alone (its session ended in
    its own time), any other applies once; ``before_batch(n)`` runs before batch n."""
    with psycopg.connect(consumer_dsn, autocommit=True) as conn:
        conn.execute(f"TRUNCATE effects, {INBOX}, {INBOX}_attempts, {INBOX}_parked")
    pool = new_ids(8)
    behaviour: dict[str, str] = {}
    expected_attempts: dict[str, int] = {}
    applied: set[str] = set()
    with closing(p):
        for n, batch in enumerate(batches):
            messages = []
            for k, what in batch:
                i = pool[k]
                behaviour.setdefault(i, what)
                messages.append(msg(i, behaviour[i].encode()))
            if before_batch is not None:
                before_batch(n)
            got = run(p, messages)
            seen: set[str] = set()
            for m, o in zip(messages, got, strict=True):
                i = str(m.message_id)
                if i in applied or i in seen:
                    assert o is D, (i, behaviour[i], got)
                elif behaviour[i] == killed_alone and o is R:
                    # its session ended while it ran alone (one by one, after the
                    # batch failed elsewhere): that is its failure, by the contract
                    expected_attempts[i] = expected_attempts.get(i, 0) + 1
                elif behaviour[i] in failing:
                    # applied one by one, each copy fails and counts on its own
                    assert o is R, (i, behaviour[i], got)
                    expected_attempts[i] = expected_attempts.get(i, 0) + 1
                else:
                    assert o is H, (i, behaviour[i], got)
                    applied.add(i)
                    seen.add(i)
        assert p.pipelining
        assert p.store.connection._pipeline is None  # no pipeline left open
    assert effect_counts(consumer_dsn) == {i: 1 for i in applied}
    assert attempts(consumer_dsn) == expected_attempts


# -- end to end: ``outbox consume`` and RabbitMQ ----------------------------------------------
def test_ahead_e2e__a_republished_batch_with_a_committing_handler_has_one_effect_each(
    topology: Topology, consumer_dsn: str, tmp_path: Path
) -> None:
    """``outbox consume handlers:act`` applies two messages; the relay's crash window
    republishes both (not redelivered), and the first copy's handler now runs
    COMMIT.  The copies must be acked without a second effect."""
    a, b = new_ids(2)
    support.publish(topology, [(a, b"ok:first"), (b, b"ok:second")])
    with support.consumer(tmp_path, consumer_dsn, topology):
        support.wait_settled(consumer_dsn, topology, [b"ok:first", b"ok:second"], 30)
    support.publish(topology, [(a, b"commit:copy"), (b, b"ok:copy")])
    with support.consumer(tmp_path, consumer_dsn, topology) as process:
        wait_for(
            lambda: "duplicate_skipped" in process.output() and support.queue_depth(topology) == 0,
            30,
            "the copies settled",
        )
        time.sleep(1.0)  # unacked copies would show in the depth once settled
        assert support.queue_depth(topology) == 0
    assert effect_counts(consumer_dsn) == {a: 1, b: 1}
    assert support.effect_bodies(consumer_dsn).count(b"commit:copy") == 0
