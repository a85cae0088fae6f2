"""Issue 31, item 5: ``async def`` handlers (``outbox.inbox.aio``) keep the inbox's
promise, embedded in an application's event loop (``consume_async``) and through
``outbox consume module:async_handler``.  The consume loop is the sync one; these
tests check what differs: the handler and the store's statements are awaited on
the application's loop, on one ``AsyncConnection``, in one transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox.amqp.message import InboxMessage
from outbox.db.inbox import ParkedStore
from outbox.inbox import aio
from outbox.inbox.handlers import HandlerNotFound
from outbox.inbox.process import Inbox
from tests.fixtures.faults import wait_for
from tests.fixtures.servers import Topology
from tests.integration.inbox import support
from tests.integration.inbox.test_inbox import (
    INBOX,
    consumer_settings,
    effects,
    new_ids,
    publish,
    ready_messages,
    record,
    running,
    scalar,
)

DOCS = Path(__file__).resolve().parents[3] / "docs" / "how-to" / "consuming.md"
INSERT = "INSERT INTO effects (message_id, body) VALUES (%s, %s)"


async def record_async(conn: psycopg.AsyncConnection[Any], message: InboxMessage) -> None:
    await conn.execute(INSERT, [message.message_id, message.body])


class Loop:
    """An application's event loop on a thread of its own, as a server runs one."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@contextlib.contextmanager
def running_async(inbox: Inbox, loop: Loop) -> Iterator[asyncio.Task[Any]]:
    """``run_async(inbox)`` as a task of ``loop``; cancelled (and awaited) at the end."""

    async def start() -> asyncio.Task[Any]:
        return asyncio.get_running_loop().create_task(aio.run_async(inbox))

    task: asyncio.Task[Any] = loop.call(start())
    try:
        yield task
    finally:

        async def cancel() -> None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        loop.call(cancel())


@pytest.fixture
def app_loop() -> Iterator[Loop]:
    loop = Loop()
    yield loop
    loop.close()


def consumer_sessions(dsn: str) -> int:
    return int(
        scalar(
            dsn,
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-consume' "
            "AND datname = current_database()",
        )
    )


# -- the promise, embedded ---------------------------------------------------------------
def test_async__effects_and_inbox_rows_commit_in_one_transaction_once_each(
    topology: Topology, consumer_dsn: str, app_loop: Loop
) -> None:
    ids = new_ids(12)
    publish(topology, [(i, f"body {i}".encode()) for i in ids] + [(ids[0], b"copy")])
    seen_on: set[int] = set()

    async def handler(conn: psycopg.AsyncConnection[Any], message: InboxMessage) -> None:
        assert isinstance(conn, psycopg.AsyncConnection)
        seen_on.add(threading.get_ident())
        await record_async(conn, message)

    inbox = aio.async_inbox(handler, consumer_settings(topology, consumer_dsn), app_loop.loop)
    with running_async(inbox, app_loop):
        wait_for(lambda: inbox.stats.duplicates_skipped == 1, 20, "12 effects and 1 copy")
    assert effects(consumer_dsn) == [(i, f"body {i}".encode()) for i in ids]
    assert seen_on == {app_loop.thread.ident}  # awaited on the application's loop
    # Each effect was written in the transaction that wrote its message's inbox row.
    assert scalar(
        consumer_dsn,
        "SELECT count(*) FROM effects e JOIN inbox i USING (message_id) "
        "WHERE e.xmin::text = i.xmin::text",
    ) == len(ids)
    assert ready_messages(topology) == 0 and topology.messages() == []
    assert consumer_sessions(consumer_dsn) == 0  # closed when cancelled


def test_async__the_handlers_session_has_the_plain_consumers_lock_timeout(
    topology: Topology, consumer_dsn: str, app_loop: Loop
) -> None:
    """The same bounds as ``outbox consume``'s plain session: a lock_timeout of 5 s
    (a handler waiting longer fails; a store statement meeting a held inbox row
    gives it back), no statement_timeout.  Async sessions had none (issue 31,
    found by an adversarial test: a new session waited for ever on the rows of
    one the consumer had given up)."""
    [one] = new_ids(1)
    publish(topology, [(one, b"x")])
    seen: list[tuple[str, str]] = []

    async def handler(conn: psycopg.AsyncConnection[Any], message: InboxMessage) -> None:
        cur = await conn.execute(
            "SELECT current_setting('lock_timeout'), current_setting('statement_timeout')"
        )
        row = await cur.fetchone()
        assert row is not None
        seen.append((str(row[0]), str(row[1])))
        await record_async(conn, message)

    inbox = aio.async_inbox(handler, consumer_settings(topology, consumer_dsn), app_loop.loop)
    with running_async(inbox, app_loop):
        wait_for(lambda: inbox.stats.handled == 1, 20, "1 effect")
    assert seen == [("5s", "0")]


def test_async__an_effect_of_a_failed_async_handler_is_rolled_back_with_its_id(
    topology: Topology, consumer_dsn: str, app_loop: Loop
) -> None:
    """The inbox row and the effect are one transaction: a failure after the effect
    leaves neither, and the next attempt applies it once."""
    [message_id] = new_ids(1)
    calls: list[int] = []

    async def handler(conn: psycopg.AsyncConnection[Any], message: InboxMessage) -> None:
        await record_async(conn, message)
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("after the effect")

    publish(topology, [(message_id, b"once")])
    inbox = aio.async_inbox(handler, consumer_settings(topology, consumer_dsn), app_loop.loop)
    with running_async(inbox, app_loop):
        wait_for(lambda: inbox.stats.handled == 1, 20, "the second attempt")
    assert effects(consumer_dsn) == [(message_id, b"once")]
    assert (len(calls), inbox.stats.handler_failures) == (2, 1)


def test_async__a_batch_of_async_handlers_runs_in_pipeline_mode(
    topology: Topology, consumer_dsn: str, app_loop: Loop
) -> None:
    """Their statements go out without waiting (the inbox's promise unchanged: one
    transaction per batch); a result a handler awaits is there."""
    ids = new_ids(10)
    publish(topology, [(i, b"x") for i in ids])
    modes: list[bool] = []

    async def handler(conn: psycopg.AsyncConnection[Any], message: InboxMessage) -> None:
        modes.append(conn._pipeline is not None)
        cur = await conn.execute("SELECT %s::text", [message.message_id])
        assert await cur.fetchone() == (message.message_id,)
        await record_async(conn, message)

    inbox = aio.async_inbox(handler, consumer_settings(topology, consumer_dsn), app_loop.loop)
    with running_async(inbox, app_loop):
        wait_for(lambda: inbox.stats.handled == len(ids), 20, "10 effects")
    assert sorted(effects(consumer_dsn)) == sorted((i, b"x") for i in ids)
    assert any(modes) and inbox.processor is not None and inbox.processor.pipelining


def test_async__a_batch_is_awaited_in_one_go_each_call_timed_on_its_own(
    topology: Topology, consumer_dsn: str, app_loop: Loop
) -> None:
    """A pipelined batch's handlers run ahead on the loop in one go (one thread
    hop, not one per message); the handler-time histogram still gets each call's
    own time."""
    ids = new_ids(5)
    publish(topology, [(i, b"x") for i in ids])
    hops: list[int] = []  # the consumer thread's hop each call ran in
    seen: list[int] = []

    async def handler(conn: psycopg.AsyncConnection[Any], message: InboxMessage) -> None:
        seen.append(len(hops))
        await asyncio.sleep(0.03)
        await record_async(conn, message)

    inbox = aio.async_inbox(handler, consumer_settings(topology, consumer_dsn), app_loop.loop)
    assert isinstance(inbox.handler, aio.AwaitedHandler)
    bridge = inbox.handler.bridge
    hop = bridge.run

    def counted(coro: Any) -> Any:
        hops.append(1)
        return hop(coro)

    bridge.run = counted  # type: ignore[method-assign]
    with running_async(inbox, app_loop):
        wait_for(lambda: inbox.stats.handled == len(ids), 20, "5 effects")
    assert sorted(effects(consumer_dsn)) == sorted((i, b"x") for i in ids)
    assert len(set(seen)) < len(ids)
    seconds = inbox.stats.handler_seconds.snapshot()
    assert seconds.count == len(ids)
    assert dict(seconds.buckets)[0.025] == 0  # each call 30 ms, none ~0 s


def test_async__a_batch_run_ahead_stops_at_the_failing_handler_and_commits_nothing_of_it(
    topology: Topology, consumer_dsn: str, app_loop: Loop
) -> None:
    ids = new_ids(6)
    publish(topology, [(i, b"x") for i in ids])
    calls: dict[str, int] = {}

    async def handler(conn: psycopg.AsyncConnection[Any], message: InboxMessage) -> None:
        calls[message.message_id] = calls.get(message.message_id, 0) + 1
        await record_async(conn, message)
        if message.message_id == ids[2] and calls[ids[2]] == 1:
            raise RuntimeError("its first call fails")

    inbox = aio.async_inbox(handler, consumer_settings(topology, consumer_dsn), app_loop.loop)
    with running_async(inbox, app_loop):
        wait_for(lambda: inbox.stats.handled == len(ids), 20, "6 effects")
    assert sorted(effects(consumer_dsn)) == sorted((i, b"x") for i in ids)
    # The batch was rolled back at its third message and applied again (its ids
    # recorded first); the messages after the failing one were not called in the
    # failed run.
    assert calls[ids[2]] == 2 and calls[ids[-1]] == 1


def test_async__a_batch_that_meets_an_id_applied_before_commits_each_effect_once(
    topology: Topology, consumer_dsn: str, app_loop: Loop
) -> None:
    """A copy that was not redelivered (a relay's crash window) in a batch whose ids
    go out ahead of the handlers' statements: its call is rolled back at the sync
    and the batch runs again with its ids recorded first."""
    ids = new_ids(5)
    calls: dict[str, int] = {}

    async def handler(conn: psycopg.AsyncConnection[Any], message: InboxMessage) -> None:
        calls[message.message_id] = calls.get(message.message_id, 0) + 1
        await record_async(conn, message)

    settings = consumer_settings(topology, consumer_dsn)
    publish(topology, [(i, b"x") for i in ids[:2]])
    inbox = aio.async_inbox(handler, settings, app_loop.loop)
    with running_async(inbox, app_loop):
        wait_for(lambda: inbox.stats.handled == 2, 20, "2 effects")
    publish(topology, [(ids[0], b"x"), *((i, b"x") for i in ids[2:])])
    wait_for(lambda: ready_messages(topology) == 4, 10, "4 messages ready")
    again = aio.async_inbox(handler, settings, app_loop.loop)
    with running_async(again, app_loop):
        wait_for(lambda: again.stats.handled == 3, 20, "3 more effects")
        wait_for(lambda: again.stats.duplicates_skipped == 1, 20, "the copy skipped")
    assert sorted(effects(consumer_dsn)) == sorted((i, b"x") for i in ids)
    # The copy's call rolled back (or, psycopg having read the ids' error while the
    # block's first statements went out, never made ahead); each once more after.
    assert calls[ids[0]] in (1, 2) and calls[ids[1]] == 1
    assert again.processor is not None and again.processor.pipelining


def test_async__a_handler_breaking_the_contract_in_a_batch_fails_only_its_message(
    topology: Topology, consumer_dsn: str, app_loop: Loop
) -> None:
    """Run ahead, each call's session is checked as it returns (``loop.handler_left``):
    the one that changed a setting fails and is parked; the others apply once."""
    bad, *good = new_ids(5)
    publish(topology, [(good[0], b"x"), (bad, b"x"), *[(g, b"x") for g in good[1:]]])

    async def handler(conn: psycopg.AsyncConnection[Any], message: InboxMessage) -> None:
        await record_async(conn, message)
        if message.message_id == bad:
            conn.prepare_threshold = None  # a setting: the contract forbids it

    settings = consumer_settings(topology, consumer_dsn, max_attempts=2)
    inbox = aio.async_inbox(handler, settings, app_loop.loop)
    with running_async(inbox, app_loop):
        wait_for(lambda: inbox.stats.parked == 1 and inbox.stats.handled == 4, 20)
    assert sorted(effects(consumer_dsn)) == sorted((g, b"x") for g in good)
    store = ParkedStore(consumer_dsn, INBOX)
    try:
        [entry] = store.entries(10)
    finally:
        store.close()
    assert entry["message_id"] == bad and "changed the connection's settings" in entry["error"]


def test_async__a_result_property_read_too_early_in_a_batch_is_right_all_the_same(
    topology: Topology, consumer_dsn: str, app_loop: Loop
) -> None:
    """In pipeline mode ``rowcount`` cannot wait for its result: read before it
    arrived, it fails the batch (even if the handler catches that), which is applied
    again one by one without pipelining, where it is right; pipelining stays off."""
    ids = new_ids(6)
    publish(topology, [(i, b"x") for i in ids])

    async def handler(conn: psycopg.AsyncConnection[Any], message: InboxMessage) -> None:
        cur = await conn.execute("SELECT 1 UNION ALL SELECT 2")
        try:
            rows = cur.rowcount
        except psycopg.Error:
            rows = -1  # caught: its batch fails all the same
        await conn.execute(INSERT, [message.message_id, f"rowcount {rows}".encode()])

    inbox = aio.async_inbox(handler, consumer_settings(topology, consumer_dsn), app_loop.loop)
    with running_async(inbox, app_loop):
        wait_for(lambda: inbox.stats.handled == len(ids), 20, "6 effects")
    assert sorted(effects(consumer_dsn)) == sorted((i, b"rowcount 2") for i in ids)
    assert inbox.processor is not None and not inbox.processor.pipelining


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_async__a_failing_handler_is_parked_as_the_sync_one_is(
    topology: Topology, consumer_dsn: str, app_loop: Loop, kind: str
) -> None:
    bad, *good = new_ids(3)

    def refuse(message: InboxMessage) -> None:
        if message.message_id == bad:
            raise ValueError(f"cannot handle {message.message_id}")

    def sync_handler(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        refuse(message)
        record(conn, message)

    async def async_handler(conn: psycopg.AsyncConnection[Any], message: InboxMessage) -> None:
        refuse(message)
        await record_async(conn, message)

    publish(topology, [(bad, b"bad")], headers={"tenant": "acme"})
    publish(topology, [(g, b"good") for g in good])
    settings = consumer_settings(topology, consumer_dsn, max_attempts=3)
    inbox = (
        Inbox(sync_handler, settings)
        if kind == "sync"
        else aio.async_inbox(async_handler, settings, app_loop.loop)
    )
    with running(inbox) if kind == "sync" else running_async(inbox, app_loop):
        wait_for(lambda: inbox.stats.parked == 1 and inbox.stats.handled == 2, 20)
    assert sorted(m for m, _ in effects(consumer_dsn)) == sorted(good)
    assert (inbox.stats.handler_failures, inbox.stats.retried) == (3, 2)
    assert ready_messages(topology) == 0
    store = ParkedStore(consumer_dsn, INBOX)
    try:
        [entry] = store.entries(10)
    finally:
        store.close()
    assert entry["message_id"] == bad and entry["attempts"] == 3
    assert entry["error"].startswith(f"ValueError: cannot handle {bad}")
    assert entry["headers"] == {"tenant": "acme"}


@pytest.mark.parametrize("where", ["between_statements", "in_a_statement"])
def test_async__a_cancelled_handler_is_a_failed_attempt_and_the_consumer_goes_on(
    topology: Topology, consumer_dsn: str, app_loop: Loop, where: str
) -> None:
    first, second = new_ids(2)
    cancelled: list[str] = []

    async def handler(conn: psycopg.AsyncConnection[Any], message: InboxMessage) -> None:
        await record_async(conn, message)
        if message.message_id == first and not cancelled:
            cancelled.append(message.message_id)
            if where == "in_a_statement":  # a timeout cancels the statement in flight
                await asyncio.wait_for(conn.execute("SELECT pg_sleep(5)"), 0.2)  # 3.10 too
            task = asyncio.current_task()
            assert task is not None
            task.cancel()  # as a shutdown of the application would
            await asyncio.sleep(0)

    publish(topology, [(first, b"first"), (second, b"second")])
    # One at a time: a failure in a batch is replayed one by one, not counted.
    settings = consumer_settings(topology, consumer_dsn, prefetch=1)
    inbox = aio.async_inbox(handler, settings, app_loop.loop)
    with running_async(inbox, app_loop) as task:
        wait_for(lambda: inbox.stats.handled == 2, 20, "both messages")
        assert not task.done()
    assert sorted(effects(consumer_dsn)) == sorted([(first, b"first"), (second, b"second")])
    assert inbox.stats.handler_failures == 1 and cancelled == [first]


@pytest.mark.parametrize(
    ("shape", "said"),
    [
        ("cancel_return", "cancelled"),
        ("cancel", "cancelled"),
        ("cancel_raise", "cancelled"),
        ("coroutine", "did not await"),
    ],
)
def test_async__outbox_consume__a_handler_cancelling_its_own_task_fails_only_its_message(
    topology: Topology, consumer_dsn: str, tmp_path: Path, shape: str, said: str
) -> None:
    """A coroutine that cancels its own task and returns (or awaits after that, or
    raises ``CancelledError`` itself) fails its message, in a batch and alone: its
    attempts are counted, it is parked at --max-attempts, the messages around it
    are applied and the consumer goes on (before: exit 1, "unexpected CancelledError").
    So does one that returns a coroutine it did not await (before: acked as
    applied, with no effect)."""
    good = [(i, f"ok:{i}".encode()) for i in new_ids(6)]
    [bad] = [(i, f"{shape}:{i}".encode()) for i in new_ids(1)]
    support.publish(topology, [*good[:3], bad, *good[3:]])
    with support.consumer(tmp_path, consumer_dsn, topology, function="act_async"):
        support.wait_settled(consumer_dsn, topology, [b for _, b in [*good, bad]], timeout=30)
    assert sorted(support.effect_bodies(consumer_dsn)) == sorted(b for _, b in good)
    assert support.parked_bodies(consumer_dsn) == [bad[1]]
    [(attempts, error)] = support.rows(consumer_dsn, f"SELECT attempts, error FROM {INBOX}_parked")
    assert attempts == 2 and said in error, error


def test_async__consume_async_goes_on_when_a_handler_cancels_its_own_task(
    topology: Topology, consumer_dsn: str
) -> None:
    """Inside an application: a handler cancelling its own task fails its message
    (parked at --max-attempts); the task awaiting ``consume_async`` does not end
    by itself (before: it ended, every message in hand requeued), and cancelling
    it still stops the consumer."""
    bad, *good = new_ids(4)
    publish(topology, [(bad, b"bad"), *((g, b"good") for g in good)])
    s = consumer_settings(topology, consumer_dsn)

    async def handler(conn: psycopg.AsyncConnection[Any], message: InboxMessage) -> None:
        if message.message_id == bad:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            return
        await record_async(conn, message)

    async def application() -> None:
        task = asyncio.create_task(
            aio.consume_async(
                handler,
                queue=s.queue,
                dsn=s.dsn,
                amqp_url=s.amqp_url,
                inbox_table=INBOX,
                max_attempts=2,
                retry_delay=0.01,
                retry_delay_max=0.05,
            )
        )

        def settled() -> bool:
            assert not task.done(), task
            return len(effects(consumer_dsn)) == 3 and scalar(
                consumer_dsn, f"SELECT count(*) FROM {INBOX}_parked"
            )

        for _ in range(200):  # the test's own deadline, without blocking the loop
            if await asyncio.to_thread(settled):
                break
            await asyncio.sleep(0.1)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 20)

    asyncio.run(application())
    assert sorted(m for m, _ in effects(consumer_dsn)) == sorted(good)
    [(attempts, error)] = support.rows(consumer_dsn, f"SELECT attempts, error FROM {INBOX}_parked")
    assert attempts == 2 and "cancelled" in error, error
    assert consumer_sessions(consumer_dsn) == 0


def test_async__system_exit_in_a_handler_fails_its_message_not_the_applications_loop(
    topology: Topology, consumer_dsn: str, app_loop: Loop
) -> None:
    """asyncio lets SystemExit and KeyboardInterrupt out of a task into the loop's
    runner; a handler's must stay its message's failure (the BaseException policy)."""
    [message_id] = new_ids(1)
    calls: list[int] = []

    async def handler(conn: psycopg.AsyncConnection[Any], message: InboxMessage) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise SystemExit(3)
        await record_async(conn, message)

    publish(topology, [(message_id, b"once")])
    inbox = aio.async_inbox(handler, consumer_settings(topology, consumer_dsn), app_loop.loop)
    with running_async(inbox, app_loop):
        wait_for(lambda: inbox.stats.handled == 1, 20, "the second attempt")
        assert app_loop.thread.is_alive()
    assert effects(consumer_dsn) == [(message_id, b"once")]
    assert inbox.stats.handler_failures == 1


def test_async__cancelling_consume_async_finishes_the_message_in_hand_and_takes_no_more(
    topology: Topology, consumer_dsn: str
) -> None:
    """Embedded in an application's own loop (``asyncio.run``, as a server runs it):
    cancelling the task stops taking messages, finishes the one in hand (committed,
    acked), closes both connections, and raises ``CancelledError`` in the task."""
    first, second = new_ids(2)
    publish(topology, [(first, b"first"), (second, b"second")])
    s = consumer_settings(topology, consumer_dsn, prefetch=1)

    async def application() -> list[str]:
        in_hand, release = asyncio.Event(), asyncio.Event()
        handled: list[str] = []

        async def handler(conn: psycopg.AsyncConnection[Any], message: InboxMessage) -> None:
            in_hand.set()
            await release.wait()
            await record_async(conn, message)
            handled.append(str(message.message_id))

        task = asyncio.create_task(
            aio.consume_async(
                handler,
                queue=s.queue,
                dsn=s.dsn,
                amqp_url=s.amqp_url,
                inbox_table=INBOX,
                prefetch=1,
            )
        )
        await asyncio.wait_for(in_hand.wait(), 20)
        task.cancel()
        await asyncio.sleep(0.2)  # the cancellation reached the consumer, in hand still
        assert not task.done()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 20)
        return handled

    handled = asyncio.run(application())
    assert handled == [first]
    assert effects(consumer_dsn) == [(first, b"first")]
    assert consumer_sessions(consumer_dsn) == 0
    wait_for(lambda: ready_messages(topology) == 1, 10, "the second message back, not taken")


def test_async__a_sync_handler_given_to_consume_async_is_refused_in_one_line(
    topology: Topology,
) -> None:
    with pytest.raises(HandlerNotFound, match="is not an async def function"):
        asyncio.run(aio.consume_async(record, queue=topology.queue))  # type: ignore[arg-type]


# -- the documented example ------------------------------------------------------------
def docs_example() -> str:
    """The FastAPI lifespan example of docs/how-to/consuming.md (the block after
    the marker ``<!-- tested: test_async_handlers -->``)."""
    text = DOCS.read_text()
    found = re.search(r"<!-- tested: test_async_handlers -->\s*```python\n(.*?)```", text, re.S)
    assert found, "the example is gone from docs/how-to/consuming.md"
    return found.group(1)


def test_async__the_documented_lifespan_example_runs_and_stops_cleanly(
    topology: Topology, consumer_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = docs_example()
    # Without FastAPI installed: the lifespan is a plain async context manager.
    code = code.replace("from fastapi import FastAPI\n", "")
    code = re.sub(r"\napp = FastAPI\(.*\)\n", "\n", code)
    s = consumer_settings(topology, consumer_dsn)
    monkeypatch.setenv("OUTBOX_DSN", s.dsn)
    monkeypatch.setenv("OUTBOX_AMQP_URL", s.amqp_url)
    monkeypatch.setenv("OUTBOX_QUEUE", s.queue)
    with psycopg.connect(consumer_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders_seen (order_id text, body bytea)")
    namespace: dict[str, Any] = {}
    exec(compile(code, str(DOCS), "exec"), namespace)
    ids = new_ids(3)
    publish(topology, [(i, i.encode()) for i in ids])

    def seen() -> list[str]:
        with psycopg.connect(consumer_dsn) as conn:
            return [r[0] for r in conn.execute("SELECT order_id FROM orders_seen ORDER BY 1")]

    async def application() -> None:
        async with namespace["lifespan"](None):
            await asyncio.to_thread(wait_for, lambda: len(seen()) == 3, 20, "3 orders")

    asyncio.run(application())
    assert seen() == sorted(ids)
    assert consumer_sessions(consumer_dsn) == 0


# -- outbox consume module:async_handler ------------------------------------------------
def test_async__outbox_consume_runs_an_async_def_handler(
    topology: Topology, consumer_dsn: str, tmp_path: Path
) -> None:
    good = [(i, f"ok:{i}".encode()) for i in new_ids(4)]
    bad = [(i, f"raise:{i}".encode()) for i in new_ids(1)]
    support.publish(topology, [*good, *bad, good[0]])
    with support.consumer(tmp_path, consumer_dsn, topology, function="act_async"):
        support.wait_settled(consumer_dsn, topology, [b for _, b in good + bad], timeout=30)
    assert sorted(support.effect_bodies(consumer_dsn)) == sorted(b for _, b in good)
    assert support.parked_bodies(consumer_dsn) == [bad[0][1]]
