"""Adversarial tests of the two-hop batch of ``async def`` handlers (0.6.0): the
pipeline block's end (the sync) is left for the COMMIT's hop
(``aio.LoopConnection.end_later``, ``Bridge.defer``), and the Processor's checks
between sync and COMMIT run on the application's loop
(``AsyncInboxStore.commit_unless``).

Real PostgreSQL through ``Processor`` and the real async store on an application's
loop (a thread of its own), and ``consume_async`` end to end with RabbitMQ.  The
promise checked: every message ends with exactly one committed effect (or a counted
failure / a parked row), nothing is lost, no effect commits twice, the consumer does
not hang and leaves no transaction or pipeline mode open, and the application's loop
is neither blocked nor killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from psycopg import sql

from outbox.amqp.message import InboxMessage
from outbox.errors import DatabaseUnavailable
from outbox.inbox import aio
from outbox.inbox.planning import Disposition
from outbox.inbox.steps import Processor
from tests.fixtures.faults import wait_for
from tests.fixtures.servers import Topology
from tests.integration.inbox.test_ahead_adversary import (
    INSERT,
    Calls,
    Loop,
    apply_first,
    async_processor,
    attempts,
    backend_pids,
    closing,
    copies_failures_and_kills,
    effect_counts,
    inbox_ids,
    msg,
    run,
    terminate_from_outside,
)
from tests.integration.inbox.test_async_handlers import record_async
from tests.integration.inbox.test_inbox import (
    INBOX,
    consumer_settings,
    new_ids,
    publish,
    ready_messages,
)

H, D, R, P = Disposition.HANDLED, Disposition.DUPLICATE, Disposition.RETRY, Disposition.PARKED


# -- helpers --------------------------------------------------------------------------------
@pytest.fixture
def app_loop() -> Iterator[Loop]:
    loop = Loop()
    yield loop
    if loop.thread.is_alive():
        loop.close()


def again(message_id: str, body: bytes = b"ok") -> InboxMessage:
    """A copy of a message as the broker redelivers it."""
    return InboxMessage(message_id, body, {}, "ex", "k", None, True, "q")


def setup_tables(dsn: str) -> None:
    """A deferred foreign key (refused only at COMMIT), a table a test can hold
    locked, and a deferred trigger that ends its own session at the COMMIT once."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE parents (id int PRIMARY KEY);"
            "CREATE TABLE children (parent int REFERENCES parents DEFERRABLE INITIALLY DEFERRED);"
            "CREATE TABLE held (n int);"
            "CREATE SEQUENCE commit_kills;"
            "CREATE TABLE doomed (n int);"
            "CREATE FUNCTION doom() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "  IF nextval('commit_kills') = 1 THEN "
            "    PERFORM pg_terminate_backend(pg_backend_pid()); PERFORM pg_sleep(5); "
            "  END IF; RETURN NULL; END $$;"
            "CREATE CONSTRAINT TRIGGER doom AFTER INSERT ON doomed "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION doom();"
        )


def open_transactions(dsn: str) -> list[tuple[int, str]]:
    """Sessions of the consumer inside a transaction (or a pipeline without sync)."""
    with psycopg.connect(dsn) as conn:
        got = conn.execute(
            "SELECT pid, state FROM pg_stat_activity WHERE application_name = 'outbox-consume' "
            "AND datname = current_database() AND (xact_start IS NOT NULL OR state <> 'idle')"
        ).fetchall()
    return [(int(p), str(s)) for p, s in got]


def act2(calls: Calls, dsn: str) -> Callable[..., Any]:
    """An async handler doing what the body says (after writing its effect):
    ok, divide (an error met only at the sync), orphan (refused only by the
    COMMIT), doomed (its session ends inside the COMMIT, once), slow:<s> (a
    statement the sync waits for), lockwait (a lock_timeout at the sync),
    stmt_timeout (a statement_timeout at the sync), catch_fetch (reads an error
    at once and swallows it), unfetched (a big result never read), terminate,
    kill_outside_once, rollback_begin (ends the transaction and writes in a new
    one), background (fire-and-forget tasks, one failing), nested_pipeline,
    savepoint (an error caught around a savepoint), named_cursor (a server-side
    cursor), commit, commit_method, rollback, close, read_count (rowcount read
    before its result is here)."""

    background: set[asyncio.Task[Any]] = set()

    async def fails_later() -> None:
        await asyncio.sleep(0.01)
        raise RuntimeError("a background task of the handler fails")

    async def handler(conn: psycopg.AsyncConnection[Any], message: InboxMessage) -> None:
        n = calls.add(message)
        what = message.body.decode()
        await conn.execute(INSERT, [message.message_id, message.body])
        if what == "ok":
            return
        if what == "divide":
            await conn.execute("SELECT 1/0")
        elif what == "orphan":
            await conn.execute("INSERT INTO children VALUES (42)")
        elif what == "doomed":
            await conn.execute("INSERT INTO doomed VALUES (1)")
        elif what.startswith("slow:"):
            await conn.execute("SELECT pg_sleep(%s)", [float(what.split(":", 1)[1])])
        elif what == "fk_wait":  # its deferred foreign key waits for a lock at COMMIT
            await conn.execute("SET LOCAL lock_timeout = '150ms'")
            await conn.execute("INSERT INTO children VALUES (1)")
        elif what == "lockwait":
            await conn.execute("SET LOCAL lock_timeout = '150ms'")
            await conn.execute("LOCK TABLE held IN ACCESS EXCLUSIVE MODE")
        elif what == "stmt_timeout":
            await conn.execute("SET LOCAL statement_timeout = '150ms'")
            await conn.execute("SELECT pg_sleep(2)")
        elif what == "catch_fetch":
            cur = await conn.execute("SELECT 1/0")
            with contextlib.suppress(psycopg.Error):
                await cur.fetchone()
        elif what == "unfetched":
            await conn.execute("SELECT g, repeat('x', 100) FROM generate_series(1, 20000) g")
            cur = conn.cursor()
            await cur.execute("SELECT generate_series(1, 10)")
            await cur.fetchone()  # one row of ten read, the rest left
        elif what == "terminate":
            await conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        elif what == "kill_outside_once" and n == 1:
            await asyncio.to_thread(terminate_from_outside, dsn, conn.pgconn.backend_pid)
        elif what == "rollback_begin":  # ends the batch's transaction, writes in a new one
            await conn.execute("ROLLBACK")
            await conn.execute("BEGIN READ WRITE")
            await conn.execute(INSERT, [message.message_id, b"in a new transaction"])
        elif what == "background":  # fire and forget, not on the connection
            loop = asyncio.get_running_loop()
            background.add(loop.create_task(asyncio.sleep(0.05)))
            background.add(loop.create_task(fails_later()))
        elif what == "commit":  # refused by the inbox's guard, met at the sync
            await conn.execute("COMMIT")
        elif what == "commit_method":
            await conn.commit()
        elif what == "rollback":  # the statements after it run outside the batch
            await conn.execute("ROLLBACK")
        elif what == "close":
            await conn.close()
        elif what == "nested_pipeline":  # its end syncs inside the handler
            async with conn.pipeline():
                cur = await conn.execute("SELECT %s::text", [message.message_id])
            assert await cur.fetchone() == (message.message_id,)
        elif what == "savepoint":  # an error caught around a savepoint
            with contextlib.suppress(psycopg.Error):
                async with conn.transaction():
                    await conn.execute("SELECT 1/0")
        elif what == "named_cursor":  # a server-side cursor (not in pipeline mode)
            async with conn.cursor(name="c") as named:
                await named.execute("SELECT generate_series(1, 3)")
                assert len(await named.fetchall()) == 3
        elif what == "read_count":
            cur = await conn.execute("SELECT 1 UNION ALL SELECT 2")
            assert cur.rowcount == 2

    return handler


def processor_of(
    dsn: str, topology: Topology, loop: Loop, *, max_attempts: int = 3
) -> tuple[Processor, Calls]:
    calls = Calls()
    return async_processor(dsn, topology, act2(calls, dsn), loop, max_attempts=max_attempts), calls


def hook(p: Processor, name: str, fn: Callable[[], None], *, after: bool = False) -> None:
    """Run ``fn`` on the consumer's thread before (or ``after``) each call of the
    store's method ``name``.  ``send_seal`` is the last step of the handlers' hop
    (the pipeline block ends right after it); ``commit_unless`` is the COMMIT's hop.
    The wrapper lives on the store alone (the test keeps no reference to it)."""
    store = p.store
    real = getattr(store, name)

    def hooked(*args: Any) -> Any:
        if not after:
            fn()
        got = real(*args)
        if after:
            fn()
        return got

    setattr(store, name, hooked)


def in_thread(target: Callable[[], Any], timeout: float) -> Any:
    """``target()`` on a thread; fails the test if it does not return in time."""
    out: list[Any] = []
    err: list[BaseException] = []

    def work() -> None:
        try:
            out.append(target())
        except BaseException as exc:
            err.append(exc)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"still running after {timeout} s: the consumer hangs"
    if err:
        raise err[0]
    return out[0]


# -- an error met only at the sync -----------------------------------------------------------
@pytest.mark.parametrize("bad", ["divide", "catch_fetch", "terminate", "stmt_timeout"])
@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("ids_first", [False, True])
def test_two_hop__an_error_met_only_at_the_sync_fails_only_its_message(
    topology: Topology, consumer_dsn: str, app_loop: Loop, bad: str, where: str, ids_first: bool
) -> None:
    """A statement's error that arrives with the deferred sync (in the COMMIT's
    hop): the batch is rolled back and applied again one by one; the culprit
    counts one attempt, nothing commits twice, and the next batch goes through."""
    setup_tables(consumer_dsn)
    ids, more = new_ids(3), new_ids(2)
    p, _ = processor_of(consumer_dsn, topology, app_loop)
    k = 0 if where == "first" else 2
    batch = [msg(i) for i in ids]
    batch[k] = msg(ids[k], bad.encode())
    expected = [H, H, H]
    expected[k] = R
    with closing(p):
        if ids_first:
            p.ahead_paused = 3
        assert run(p, batch) == expected
        assert p.stats.handler_failures == 1
        assert run(p, [msg(i) for i in more]) == [H, H]
        assert not p.store.broken
        assert p.store.connection._pipeline is None
    good = [i for n, i in enumerate(ids) if n != k] + more
    assert effect_counts(consumer_dsn) == {i: 1 for i in good}
    assert attempts(consumer_dsn) == {ids[k]: 1}
    assert inbox_ids(consumer_dsn) == set(good)
    assert open_transactions(consumer_dsn) == []


def test_two_hop__every_message_of_the_batch_fails_at_the_sync(
    topology: Topology, consumer_dsn: str, app_loop: Loop
) -> None:
    ids = new_ids(3)
    p, _ = processor_of(consumer_dsn, topology, app_loop)
    with closing(p):
        assert run(p, [msg(i, b"divide") for i in ids]) == [R, R, R]
        assert p.stats.handler_failures == 3
    assert effect_counts(consumer_dsn) == {}
    assert attempts(consumer_dsn) == {i: 1 for i in ids}
    assert inbox_ids(consumer_dsn) == set()


def test_two_hop__a_lock_timeout_at_the_sync_fails_only_the_waiting_message(
    topology: Topology, consumer_dsn: str, app_loop: Loop
) -> None:
    """A handler's statement waits for a lock longer than the lock_timeout it set:
    pipelined, the error arrives with the deferred sync, in the COMMIT's hop; it
    must fail the batch (applied again one by one: only that message fails)."""
    setup_tables(consumer_dsn)
    ids = new_ids(3)
    p, _ = processor_of(consumer_dsn, topology, app_loop)
    with psycopg.connect(consumer_dsn) as holder, closing(p):
        holder.execute("LOCK TABLE held IN ACCESS EXCLUSIVE MODE")
        # Found here: naming the lock's holder (db.session.holders) ran the sync
        # cursor API on the async store's LoopConnection, whose cursor's execute was a
        # coroutine; the AttributeError killed the consumer (LoopConnection.cursor now).
        got = run(p, [msg(ids[0]), msg(ids[1]), msg(ids[2], b"lockwait")])
        holder.rollback()
        assert got == [H, H, R]
        assert p.stats.handler_failures == 1
    assert effect_counts(consumer_dsn) == {ids[0]: 1, ids[1]: 1}
    assert attempts(consumer_dsn) == {ids[2]: 1}
    assert open_transactions(consumer_dsn) == []


def test_two_hop__a_lock_timeout_inside_the_commit_is_an_outage_not_a_crash(
    topology: Topology, consumer_dsn: str, app_loop: Loop
) -> None:
    """A deferred foreign key checked at the COMMIT waits for a parent row another
    transaction holds, past the lock_timeout the handler set: the COMMIT's hop
    gets LockNotAvailable; as with a plain handler that is an outage
    (StatementTimedOut), the copies the broker sends again are applied once."""
    setup_tables(consumer_dsn)
    with psycopg.connect(consumer_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO parents VALUES (1)")
    ids = new_ids(3)
    bodies = [b"ok", b"ok", b"fk_wait"]
    p, _ = processor_of(consumer_dsn, topology, app_loop)
    with psycopg.connect(consumer_dsn) as holder, closing(p):
        holder.execute("SELECT 1 FROM parents WHERE id = 1 FOR UPDATE")
        # The same AttributeError, from the COMMIT's translation.
        with pytest.raises(DatabaseUnavailable):
            run(p, [msg(i, b) for i, b in zip(ids, bodies, strict=True)])
        holder.rollback()
        p.store.reconnect()
        assert run(p, [again(i, b) for i, b in zip(ids, bodies, strict=True)]) == [H, H, H]
    assert effect_counts(consumer_dsn) == {i: 1 for i in ids}
    assert open_transactions(consumer_dsn) == []


# -- a COMMIT refused by a deferred constraint -------------------------------------------------
@pytest.mark.parametrize("ids_first", [False, True])
def test_two_hop__a_commit_refused_by_a_deferred_constraint_fails_only_its_message(
    topology: Topology, consumer_dsn: str, app_loop: Loop, ids_first: bool
) -> None:
    setup_tables(consumer_dsn)
    old, *ids = new_ids(4)
    apply_first(consumer_dsn, topology, [old])
    p, _ = processor_of(consumer_dsn, topology, app_loop)
    with closing(p):
        if ids_first:
            p.ahead_paused = 3
        got = run(p, [msg(ids[0]), msg(old), msg(ids[1], b"orphan"), msg(ids[2]), msg(old)])
        assert got == [H, D, R, H, D]
        assert p.stats.handler_failures == 1
        assert p.pipelining
    assert effect_counts(consumer_dsn) == {old: 1, ids[0]: 1, ids[2]: 1}
    assert attempts(consumer_dsn) == {ids[1]: 1}
    assert open_transactions(consumer_dsn) == []


def test_two_hop__a_redelivered_message_refused_at_its_commit_is_parked_at_max_attempts(
    topology: Topology, consumer_dsn: str, app_loop: Loop
) -> None:
    """Applied alone (not pipelined, its attempt counted first): the COMMIT's hop
    runs the checks and the COMMIT, whose refusal is its failure; at max_attempts
    its id is parked, never with an effect."""
    setup_tables(consumer_dsn)
    bad, ok1, ok2 = new_ids(3)
    p, calls = processor_of(consumer_dsn, topology, app_loop, max_attempts=2)
    with closing(p):
        assert run(p, [again(bad, b"orphan"), msg(ok1), msg(ok2)]) == [R, H, H]
        assert run(p, [again(bad, b"orphan")]) == [P]
        assert run(p, [again(bad, b"orphan")]) == [D]
    assert effect_counts(consumer_dsn) == {ok1: 1, ok2: 1}
    assert bad in inbox_ids(consumer_dsn)
    assert calls.n[bad] == 2
    with psycopg.connect(consumer_dsn) as conn:
        parked = conn.execute(f"SELECT message_id, error FROM {INBOX}_parked").fetchall()
    assert [m for m, _ in parked] == [bad]
    assert "children" in parked[0][1] or "foreign key" in parked[0][1]


# -- the session killed around the COMMIT's hop -----------------------------------------------
@pytest.mark.parametrize("ids_first", [False, True])
def test_two_hop__the_session_killed_between_the_two_hops_costs_nobody_an_attempt(
    topology: Topology, consumer_dsn: str, app_loop: Loop, ids_first: bool
) -> None:
    """Killed after the handlers' hop, before the COMMIT's: the deferred sync meets
    a dead session, nothing was committed; the batch is applied again on a new
    session, once, and nothing is counted against anyone."""
    ids = new_ids(3)
    p, _ = processor_of(consumer_dsn, topology, app_loop)
    killed: list[int] = []

    def kill() -> None:
        if killed:
            return
        pid = p.store.connection.pgconn.backend_pid
        killed.append(pid)
        terminate_from_outside(consumer_dsn, pid)
        wait_for(lambda: pid not in backend_pids(consumer_dsn), 10, "the backend gone")

    with closing(p):
        if ids_first:
            p.ahead_paused = 3
        hook(p, "send_seal", kill, after=True)
        assert run(p, [msg(i) for i in ids]) == [H, H, H]
        assert killed
        assert p.stats.handler_failures == 0 and p.pipelining
    assert effect_counts(consumer_dsn) == {i: 1 for i in ids}
    assert attempts(consumer_dsn) == {}
    assert open_transactions(consumer_dsn) == []


def test_two_hop__the_session_killed_while_the_sync_waits_costs_nobody_an_attempt(
    topology: Topology, consumer_dsn: str, app_loop: Loop
) -> None:
    """Killed during the COMMIT's hop, while the deferred sync waits for a slow
    statement of the last handler."""
    ids = new_ids(3)
    p, _ = processor_of(consumer_dsn, topology, app_loop)
    timers: list[threading.Timer] = []

    def kill_soon() -> None:
        if timers:
            return
        pid = p.store.connection.pgconn.backend_pid
        timer = threading.Timer(0.3, terminate_from_outside, [consumer_dsn, pid])
        timers.append(timer)
        timer.start()

    with closing(p):
        hook(p, "send_seal", kill_soon, after=True)
        got = run(p, [msg(ids[0]), msg(ids[1]), msg(ids[2], b"slow:1.5")])
        timers[0].join()
        assert got == [H, H, H]
        assert p.stats.handler_failures == 0
    assert effect_counts(consumer_dsn) == {i: 1 for i in ids}
    assert attempts(consumer_dsn) == {}
    assert open_transactions(consumer_dsn) == []


@pytest.mark.parametrize("alone", [False, True])
def test_two_hop__the_session_ended_inside_the_commit_is_decided_by_the_inbox(
    topology: Topology, consumer_dsn: str, app_loop: Loop, alone: bool
) -> None:
    """The COMMIT's own round trip loses the session (a deferred trigger ends it):
    the outcome is unknown, so the batch is an outage (DatabaseUnavailable, nothing
    acked); the copies the broker sends again are applied once each."""
    setup_tables(consumer_dsn)
    ids = new_ids(3)
    p, _ = processor_of(consumer_dsn, topology, app_loop)
    bodies = [b"ok", b"doomed", b"ok"]
    with closing(p):
        with pytest.raises(DatabaseUnavailable):
            if alone:  # redelivered: each applied alone, not pipelined
                for i, body in zip(ids, bodies, strict=True):
                    run(p, [again(i, body)])
            else:
                run(p, [msg(i, body) for i, body in zip(ids, bodies, strict=True)])
        p.store.reconnect()  # as the Inbox does after an outage
        got = run(p, [again(i, body) for i, body in zip(ids, bodies, strict=True)])
        assert got == ([D, H, H] if alone else [H, H, H])
    assert effect_counts(consumer_dsn) == {i: 1 for i in ids}
    assert attempts(consumer_dsn) == {}
    assert open_transactions(consumer_dsn) == []


def test_two_hop__a_single_message_whose_session_ends_before_its_commit_is_an_outage(
    topology: Topology, consumer_dsn: str, app_loop: Loop
) -> None:
    """Not pipelined (one message): the seal has its hop, the checks and the COMMIT
    the next one; a session killed between them is an outage (nothing committed,
    nothing counted), and the copy the broker sends again is applied once."""
    [one] = new_ids(1)
    p, _ = processor_of(consumer_dsn, topology, app_loop)
    killed: list[int] = []

    def kill() -> None:
        if not killed:
            pid = p.store.connection.pgconn.backend_pid
            killed.append(pid)
            terminate_from_outside(consumer_dsn, pid)
            wait_for(lambda: pid not in backend_pids(consumer_dsn), 10, "the backend gone")

    with closing(p):
        hook(p, "commit_unless", kill)
        with pytest.raises(DatabaseUnavailable):
            run(p, [msg(one)])
        assert p.stats.handler_failures == 0
        p.store.reconnect()
        assert run(p, [again(one)]) == [H]
    assert effect_counts(consumer_dsn) == {one: 1}
    assert attempts(consumer_dsn) == {}


# -- the application's loop stopped between the hops ------------------------------------------
def restart(loop: Loop) -> None:
    loop.thread = threading.Thread(target=loop.loop.run_forever, daemon=True)
    loop.thread.start()
    wait_for(loop.loop.is_running, 5, "the loop running again")


def test_two_hop__the_loop_stopped_between_the_hops_leaves_no_transaction_behind(
    topology: Topology, consumer_dsn: str, app_loop: Loop
) -> None:
    """The application stops its loop (``loop.stop()``) after the handlers' hop,
    the block's end still deferred; later it runs the loop again.  The batch is an
    outage (nothing committed); the consumer, as ``Inbox`` does, drops its store
    and connects a new one once the loop runs; the copies the broker sends again
    are applied once each, without waiting for the session the batch was on."""
    ids = new_ids(3)
    p, _ = processor_of(consumer_dsn, topology, app_loop)
    store = p.store
    assert isinstance(store, aio.AsyncInboxStore)
    bridge, ahead = store._bridge, store._ahead
    stopped: list[int] = []

    def stop() -> None:
        if not stopped:
            stopped.append(1)
            app_loop.loop.call_soon_threadsafe(app_loop.loop.stop)
            app_loop.thread.join(10)

    hook(p, "send_seal", stop, after=True)

    def reconnect_and_apply_the_copies() -> list[Disposition]:
        fresh = aio.AsyncInboxStore(p.settings, bridge, ahead)
        fresh.ensure_schema()  # Inbox._connect_database
        p.store = fresh
        return run(p, [again(i) for i in ids])

    try:
        with pytest.raises(DatabaseUnavailable):
            in_thread(lambda: run(p, [msg(i) for i in ids]), 20)
        store.close()  # Inbox._outage, the loop still stopped
        del store
        restart(app_loop)
        # Found here: the batch's AsyncConnection could not be closed while the loop
        # was stopped (its close ran on the loop), so its session stayed in the batch's
        # transaction holding the inbox rows, and the async sessions had no lock_timeout:
        # the new store waited for ever.  LoopConnection.close now ends the session from
        # the consumer's thread when the loop does not run, and async sessions get the
        # plain consumer's lock_timeout.
        assert in_thread(reconnect_and_apply_the_copies, 8) == [H, H, H]
        assert open_transactions(consumer_dsn) == []
    finally:
        # Whatever the consumer left behind must not outlive the test.
        for pid, _ in open_transactions(consumer_dsn):
            terminate_from_outside(consumer_dsn, pid)
        time.sleep(0.5)  # a consumer thread stuck on it ends meanwhile
        with contextlib.suppress(Exception):
            p.store.close()
    assert effect_counts(consumer_dsn) == {i: 1 for i in ids}


def test_two_hop__the_loop_stopped_before_a_single_messages_commit_counts_no_attempt(
    topology: Topology, consumer_dsn: str, app_loop: Loop
) -> None:
    """One message, not pipelined: its handler and seal went fine, then the
    application stops its loop before the COMMIT's hop.  Nothing was committed and
    the handler did not fail: an outage, as the same stop before a plain COMMIT
    was before 0.6.0, with no attempt counted against the message.  With
    max_attempts=1 such an attempt would park it unapplied."""
    [one] = new_ids(1)
    p, calls = processor_of(consumer_dsn, topology, app_loop, max_attempts=1)
    store = p.store
    assert isinstance(store, aio.AsyncInboxStore)
    stopped: list[int] = []

    def stop() -> None:
        if not stopped:
            stopped.append(1)
            app_loop.loop.call_soon_threadsafe(app_loop.loop.stop)
            app_loop.thread.join(10)

    hook(p, "commit_unless", stop)
    try:
        with pytest.raises(DatabaseUnavailable):
            in_thread(lambda: run(p, [msg(one)]), 20)
        failures = p.stats.handler_failures
    finally:
        if not app_loop.loop.is_running():
            restart(app_loop)
        store.close()  # the loop runs again: the message's session can end now
    fresh = aio.AsyncInboxStore(p.settings, store._bridge, store._ahead)
    fresh.ensure_schema()
    p.store = fresh
    with closing(p):
        got = in_thread(lambda: run(p, [again(one)]), 15)
    # Found here (a regression of the two-hop change): the bridge's refusal
    # (the loop not running, nothing sent) was taken for the batch's failure, the
    # attempt owed, and at max_attempts=1 the message parked unapplied.  The
    # refusal is LoopNotRunning now, an outage.
    with psycopg.connect(consumer_dsn) as conn:
        parked = conn.execute(f"SELECT error FROM {INBOX}_parked").fetchall()
    assert (got, parked) == ([H], [])
    assert failures == 0
    assert calls.n[one] == 2
    assert effect_counts(consumer_dsn) == {one: 1}


# -- consume_async end to end -------------------------------------------------------------------
def consume_until(
    topology: Topology, dsn: str, handler: Any, done: Callable[[], bool], timeout: float = 20
) -> None:
    """``consume_async`` in an application's ``asyncio.run`` until ``done()``, then
    cancelled; the consumer must still be running when it is."""
    s = consumer_settings(topology, dsn)

    async def application() -> None:
        task = asyncio.create_task(
            aio.consume_async(
                handler, queue=s.queue, dsn=s.dsn, amqp_url=s.amqp_url, inbox_table=INBOX
            )
        )
        deadline = time.monotonic() + timeout
        while not await asyncio.to_thread(done):
            assert not task.done(), task.exception()  # the consumer died
            assert time.monotonic() < deadline, "not done in time"
            await asyncio.sleep(0.05)
        assert not task.done(), task.exception()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 20)

    in_thread(lambda: asyncio.run(application()), timeout + 30)


def settled_once(topology: Topology, dsn: str, ids: list[str]) -> None:
    """What a first consumer left is applied by a second one: each id exactly once."""
    counts = effect_counts(dsn)
    assert all(n == 1 for n in counts.values()), counts
    assert open_transactions(dsn) == []
    assert backend_pids(dsn) == []  # both connections closed
    left = [i for i in ids if i not in counts]
    wait_for(lambda: ready_messages(topology) == len(left), 15, f"{len(left)} messages back")
    if left:
        consume_until(topology, dsn, record_async, lambda: len(effect_counts(dsn)) == len(ids))
    assert effect_counts(dsn) == {i: 1 for i in ids}
    wait_for(lambda: ready_messages(topology) == 0, 10, "the queue drained")


def test_two_hop_e2e__cancelling_consume_async_while_a_batch_waits_for_its_commit_hop(
    topology: Topology, consumer_dsn: str
) -> None:
    """The task awaiting consume_async is cancelled after the batch's handlers ran
    ahead, while its COMMIT's hop waits for the deferred sync (a slow statement of
    the last handler): the batch ends (committed and acked, or rolled back and
    back in the queue), both connections close, nothing is applied twice."""
    ids = new_ids(6)
    publish(topology, [(i, b"x") for i in ids])
    s = consumer_settings(topology, consumer_dsn)

    async def application() -> None:
        ran = asyncio.Event()

        async def handler(conn: psycopg.AsyncConnection[Any], message: InboxMessage) -> None:
            await record_async(conn, message)
            if message.message_id == ids[-1] and not ran.is_set():
                await conn.execute("SELECT pg_sleep(0.6)")  # the sync waits for it
                ran.set()

        task = asyncio.create_task(
            aio.consume_async(
                handler, queue=s.queue, dsn=s.dsn, amqp_url=s.amqp_url, inbox_table=INBOX
            )
        )
        await asyncio.wait_for(ran.wait(), 20)
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 20)

    in_thread(lambda: asyncio.run(application()), 40)
    settled_once(topology, consumer_dsn, ids)


def test_two_hop_e2e__the_application_shutting_down_mid_commit_hop_loses_nothing(
    topology: Topology, consumer_dsn: str
) -> None:
    """The application's ``asyncio.run`` ends while a batch's COMMIT's hop waits
    for the deferred sync: asyncio cancels every task left, the hop's own one
    included.  The consumer must not hang the shutdown, must close its sessions,
    and whatever it did not commit comes back and is applied once."""
    ids = new_ids(6)
    publish(topology, [(i, b"x") for i in ids])
    s = consumer_settings(topology, consumer_dsn)
    kept: list[asyncio.Task[Any]] = []

    async def application() -> None:
        ran = asyncio.Event()

        async def handler(conn: psycopg.AsyncConnection[Any], message: InboxMessage) -> None:
            await record_async(conn, message)
            if message.message_id == ids[-1] and not ran.is_set():
                await conn.execute("SELECT pg_sleep(1)")  # the sync waits for it
                ran.set()

        kept.append(
            asyncio.create_task(
                aio.consume_async(
                    handler, queue=s.queue, dsn=s.dsn, amqp_url=s.amqp_url, inbox_table=INBOX
                )
            )
        )
        await asyncio.wait_for(ran.wait(), 20)
        await asyncio.sleep(0.3)  # the COMMIT's hop is waiting at the sync now
        # returns: asyncio.run cancels the tasks left and waits for them

    in_thread(lambda: asyncio.run(application()), 40)
    settled_once(topology, consumer_dsn, ids)


def test_two_hop_e2e__a_lock_timeout_met_at_the_sync_does_not_kill_consume_async(
    topology: Topology, consumer_dsn: str
) -> None:
    """The database sets lock_timeout (as an operator does for an application's
    role); a handler's UPDATE waits for a row an application transaction holds.
    Pipelined, the wait's error arrives with the deferred sync in the COMMIT's hop:
    it must fail that batch like any other statement error, not the consumer."""
    with psycopg.connect(consumer_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE stock (id int PRIMARY KEY, n int)")
        conn.execute("INSERT INTO stock VALUES (1, 0)")
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET lock_timeout = '200ms'").format(
                sql.Identifier(str(conn.info.dbname))
            )
        )
    ids = new_ids(4)

    async def handler(conn: psycopg.AsyncConnection[Any], message: InboxMessage) -> None:
        await record_async(conn, message)
        if message.body == b"stock":
            await conn.execute("UPDATE stock SET n = n + 1 WHERE id = 1")

    with psycopg.connect(consumer_dsn) as holder:
        holder.execute("SELECT * FROM stock WHERE id = 1 FOR UPDATE")
        publish(topology, [(i, b"stock" if k == 2 else b"x") for k, i in enumerate(ids)])
        release = threading.Timer(1.5, holder.rollback)
        release.start()
        try:
            # Found here: the lock_timeout's translation killed the consumer (see
            # test_two_hop__a_lock_timeout_at_the_sync_fails_only_the_waiting_message).
            consume_until(
                topology, consumer_dsn, handler, lambda: len(effect_counts(consumer_dsn)) == 4
            )
        finally:
            release.join()
    assert effect_counts(consumer_dsn) == {i: 1 for i in ids}
    with psycopg.connect(consumer_dsn) as conn:
        assert conn.execute("SELECT n FROM stock").fetchone() == (1,)


# -- batches mixing copies, failures and odd handlers ------------------------------------------
MIXED = {
    "copies_around_a_sync_error": (
        ["old", "a:ok", "b:divide", "old", "a:ok", "c:ok"],
        [D, H, R, D, D, H],
    ),
    "copies_around_a_refused_commit": (
        ["a:ok", "old", "b:orphan", "c:ok", "old"],
        [H, D, R, H, D],
    ),
    "a_swallowed_error_and_a_copy": (
        ["old", "a:catch_fetch", "b:ok", "b:ok"],
        [D, R, H, D],
    ),
    "a_new_transaction_last": (
        ["a:ok", "b:ok", "c:rollback_begin"],
        [H, H, R],
    ),
    "a_new_transaction_in_the_middle": (
        ["a:ok", "b:rollback_begin", "c:ok", "old"],
        [H, R, H, D],
    ),
    "killed_from_outside_last": (
        ["a:ok", "old", "b:ok", "c:kill_outside_once"],
        [H, D, H, H],
    ),
    "terminate_last_with_copies": (
        ["old", "a:ok", "b:terminate"],
        [D, H, R],
    ),
    "unfetched_results_and_background_tasks": (
        ["a:unfetched", "b:background", "old", "c:unfetched", "d:background"],
        [H, H, D, H, H],
    ),
    "a_commit_last": (["old", "a:ok", "b:commit"], [D, H, R]),
    "a_commit_method_last": (["a:ok", "old", "b:commit_method"], [H, D, R]),
    "a_rollback_last": (["a:ok", "b:ok", "c:rollback"], [H, H, R]),
    "a_close_last": (["a:ok", "old", "b:close"], [H, D, R]),
    "a_nested_pipeline_and_copies": (
        ["old", "a:nested_pipeline", "b:ok", "old"],
        [D, H, H, D],
    ),
    "a_savepoint_around_an_error": (
        ["a:ok", "b:savepoint", "c:ok"],
        [H, H, H],
    ),
    "a_server_side_cursor": (
        ["a:ok", "b:named_cursor", "old", "c:ok"],
        [H, H, D, H],
    ),
    "rowcount_too_early": (
        ["a:ok", "b:read_count", "old", "c:ok"],
        [H, H, D, H],
    ),
}


@pytest.mark.parametrize("case", sorted(MIXED))
@pytest.mark.parametrize("ids_first", [False, True])
def test_two_hop__mixed_batches_apply_each_message_once(
    topology: Topology, consumer_dsn: str, app_loop: Loop, case: str, ids_first: bool
) -> None:
    """One batch of first deliveries (and copies of an id applied before): the
    expected dispositions, one effect per applied id (never the one a handler
    wrote in a transaction of its own), one attempt per failed one, nothing
    left open, and the next batch goes through."""
    setup_tables(consumer_dsn)
    [old] = new_ids(1)
    apply_first(consumer_dsn, topology, [old])
    named = dict(zip("abcd", new_ids(4), strict=True))
    spec, expected = MIXED[case]
    batch = []
    for item in spec:
        if item == "old":
            batch.append(msg(old))
        else:
            name, body = item.split(":")
            batch.append(msg(named[name], body.encode()))
    p, _ = processor_of(consumer_dsn, topology, app_loop)
    more = new_ids(2)
    with closing(p):
        if ids_first:
            p.ahead_paused = 3
        assert run(p, batch) == expected
        assert run(p, [msg(i) for i in more]) == [H, H]
        assert p.store.connection._pipeline is None
    applied = {str(m.message_id) for m, o in zip(batch, expected, strict=True) if o is H}
    failed = {str(m.message_id) for m, o in zip(batch, expected, strict=True) if o is R}
    assert effect_counts(consumer_dsn) == {i: 1 for i in {old, *applied, *more}}
    assert attempts(consumer_dsn) == {i: 1 for i in failed}
    assert inbox_ids(consumer_dsn) == {old, *applied, *more}
    with psycopg.connect(consumer_dsn) as conn:
        stray = conn.execute(
            "SELECT count(*) FROM effects WHERE body = 'in a new transaction'"
        ).fetchone()
    assert stray == (0,)
    assert open_transactions(consumer_dsn) == []


def test_two_hop__the_applications_loop_keeps_running_through_big_batches(
    topology: Topology, consumer_dsn: str, app_loop: Loop
) -> None:
    """A ticker on the application's loop: the consumer's hops (the handlers, then
    the sync, the checks and the COMMIT) never hold the loop for long, and the
    handlers' background tasks (one of them failing) do not stop it."""
    ids = new_ids(60)
    bodies = [
        b"unfetched" if k % 3 == 0 else b"background" if k % 3 == 1 else b"ok" for k in range(60)
    ]
    p, _ = processor_of(consumer_dsn, topology, app_loop)
    gaps: list[float] = []
    stop = threading.Event()

    async def ticker() -> None:
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticking = asyncio.run_coroutine_threadsafe(ticker(), app_loop.loop)
    with closing(p):
        for start in range(0, 60, 20):
            chunk = list(zip(ids[start : start + 20], bodies[start : start + 20], strict=True))
            assert run(p, [msg(i, b) for i, b in chunk]) == [H] * 20
    stop.set()
    ticking.result(5)
    assert app_loop.thread.is_alive() and app_loop.loop.is_running()
    assert max(gaps) < 0.5, max(gaps)
    assert effect_counts(consumer_dsn) == {i: 1 for i in ids}


# -- a property: copies, failures met at the sync or the COMMIT, kills between the hops -------
FAILING = {"divide", "orphan", "catch_fetch", "rollback_begin", "terminate"}
BEHAVIOURS = ["ok", "ok", "ok", "kill_outside_once", *sorted(FAILING)]
PROPERTY = hypothesis_settings(
    max_examples=int(os.environ.get("OUTBOX_TWO_HOP_EXAMPLES", "8")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@PROPERTY
@given(
    batches=st.lists(
        st.tuples(
            st.lists(
                st.tuples(st.integers(0, 5), st.sampled_from(BEHAVIOURS)), min_size=2, max_size=5
            ),
            st.booleans(),  # the session killed between the handlers' hop and the COMMIT's
        ),
        min_size=1,
        max_size=3,
    )
)
def test_two_hop__property_copies_failures_and_kills_between_the_hops(
    topology: Topology,
    consumer_dsn: str,
    app_loop: Loop,
    batches: list[tuple[list[tuple[int, str]], bool]],
) -> None:
    """Ids from a small pool (copies across and inside batches), each keeping its
    first behaviour.  A good id: one effect, no attempt, its copies duplicates; a
    bad one: no effect, one attempt per delivery; a kill between the hops costs
    nobody anything."""
    p, _ = processor_of(consumer_dsn, topology, app_loop, max_attempts=100)
    with psycopg.connect(consumer_dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS parents (id int PRIMARY KEY);"
            "CREATE TABLE IF NOT EXISTS children "
            "(parent int REFERENCES parents DEFERRABLE INITIALLY DEFERRED)"
        )
    kill_next: list[bool] = [False]

    def kill() -> None:
        if kill_next[0]:
            kill_next[0] = False
            terminate_from_outside(consumer_dsn, p.store.connection.pgconn.backend_pid)

    def before_batch(n: int) -> None:
        kill_next[0] = batches[n][1]

    hook(p, "send_seal", kill, after=True)
    copies_failures_and_kills(
        p,
        consumer_dsn,
        [batch for batch, _ in batches],
        failing=FAILING,
        killed_alone="kill_outside_once",
        before_batch=before_batch,
    )
    assert open_transactions(consumer_dsn) == []
