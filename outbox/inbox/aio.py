"""``async def`` handlers: the same consumer, its database I/O on the application's loop.

There is one consume loop (``process.Inbox`` and ``steps.Processor``: planning, batches,
retries, parking, the queue's policies) and it is not written twice.  What differs
for an async handler is only where the I/O runs:

- the loop runs on a thread of its own, with its kombu broker (heartbeats and all,
  as in ``outbox consume``);
- its store is ``InboxStore`` over the same statements (``inbox.sql``), but its
  session is a psycopg ``AsyncConnection`` that lives on the application's event
  loop: each of the store's statements is awaited there (``Bridge``), and so is
  the handler, with that same ``AsyncConnection``.

So the inbox row and the handler's effects are written on one session in one
transaction and commit together, exactly as with a plain handler, and the handler
contract is checked the same way (``steps.handler_left``).  The application's loop
is never blocked: it only runs the awaited statements and the handler, while the
thread waits for them.

Speed: each wait is a thread hop (the loop wakes, runs, wakes the thread), which
costs more than the statement on a busy machine.  So a batch (messages already
here) runs as with a plain handler in pipeline mode (``AsyncPipeline``: the
handlers' statements do not wait for their results; ``AsyncPipelinedCursor``), and
its handlers are awaited one after the other on the loop in ONE hop
(``AwaitedHandler.outbox_run_ahead``), the Processor then taking each call's outcome and
session in order; the store's statements bring their rows back in their own hop.
The hop that runs the handlers also enters pipeline mode and sends the batch's ids
ahead of them (``Bridge.defer``, ``steps.record_ahead``), and the block's end (the
sync) is left for the COMMIT's hop, where the Processor's checks run on the loop
between the two (``AsyncInboxStore.commit_unless``).  So a batch of first
deliveries costs two hops whatever its size (the handlers; the sync and the COMMIT),
not one or two per message.  A hop is worth saving: on a busy 2-core machine the
two thread wake-ups of one cost 170-450 us (median, mean), more than the batch's
statements.

``consume_async`` runs it from inside an application's loop (a FastAPI lifespan
task, say); ``outbox consume`` runs it when the handler is an ``async def``.
Cancelling the task that awaits ``consume_async`` stops taking messages, lets the
message in hand finish (committed and acked, or rolled back and left to the
broker), closes both connections, then raises ``CancelledError``.  Each handler
call is awaited in a task of its own (``_call_handler``): a handler that cancels
its own task fails its message, while a hop cancelled by the application (a
shutdown cancelling every task) is an outage for the consumer (``Bridge.run``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import datetime
import inspect
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar, cast

import psycopg
from psycopg import Column
from psycopg.pq import ExecStatus, PipelineStatus
from psycopg.rows import Row, tuple_row

from outbox.amqp.message import InboxMessage
from outbox.config import DEFAULT_AMQP_URL, DEFAULT_DSN
from outbox.db.inbox import InboxStore, SessionState, StatementRefused, session_state
from outbox.db.session import bound_statements, cannot_connect, connect_options, first_line
from outbox.errors import DatabaseUnavailable, OutboxError
from outbox.inbox.handlers import Handler, HandlerNotFound
from outbox.inbox.process import Inbox
from outbox.inbox.settings import ConsumerSettings
from outbox.inbox.stats import ConsumerStats
from outbox.inbox.steps import handler_left, not_run

T = TypeVar("T")
TUPLES_OK = ExecStatus.TUPLES_OK

AsyncHandler = Callable[["psycopg.AsyncConnection[Any]", InboxMessage], Awaitable[object]]


def is_async(handler: object) -> bool:
    """Whether ``handler`` is an ``async def`` function (or an object whose
    ``__call__`` is one)."""
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)  # noqa: B004 - the method, not callable()
    )


class LoopNotRunning(DatabaseUnavailable):
    """The application's loop does not run (stopped, closed, or this is its own
    thread): nothing was sent, an outage for the consumer, no message's failure."""


class Bridge:
    """Runs coroutines on the application's loop from the consumer's thread and
    waits for their outcome (their exception is raised here as it was there)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._deferred: list[Coroutine[Any, Any, None]] = []

    def defer(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` at the start of the next hop, before that hop's own
        coroutine: two steps for one hop.  If it raises, the hop's coroutine does
        not run and the hop raises that."""
        self._deferred.append(coro)

    def drop_deferred(self) -> bool:
        """Forget the coroutines not run yet; whether there were any."""
        deferred, self._deferred = self._deferred, []
        for coro in deferred:
            coro.close()
        return bool(deferred)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        # Waiting on the loop's own thread, or for a loop that does not run, would
        # wait for ever: refuse (the callers treat it as the session being gone).
        if not self.loop.is_running() or _running_loop() is self.loop:
            coro.close()
            self.drop_deferred()
            raise _not_running()
        deferred, self._deferred = self._deferred, []
        if deferred:
            coro = _after(deferred, coro)
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        while True:
            try:
                return future.result(timeout=LOOP_CHECK_SECONDS)
            except concurrent.futures.CancelledError:
                # Something on the loop cancelled the hop's task (an application
                # shutting down cancels every task): never a handler, which runs in
                # a task of its own (``_call_handler``).  The session's state is
                # unknown: an outage, and the consumer reconnects if it goes on.
                raise _not_running("cancelled the consumer's work") from None
            except (TimeoutError, concurrent.futures.TimeoutError):  # one class from 3.11
                if future.done():  # the coroutine's own TimeoutError
                    raise
                # A loop stopped mid-hop may run again (the hop goes on then); a
                # closed one never will: its task is gone, stop waiting for it.
                if self.loop.is_closed():
                    future.cancel()
                    raise _not_running() from None


# How often a hop that waits checks that the application's loop was not closed.
LOOP_CHECK_SECONDS = 1.0


def _not_running(what: str = "is not running") -> LoopNotRunning:
    return LoopNotRunning(
        f"the application's event loop {what}",
        "the consumer goes on once it runs again; stop the consumer first "
        "(cancel the task awaiting consume_async) when stopping the loop",
    )


async def _after(first: list[Coroutine[Any, Any, None]], then: Coroutine[Any, Any, T]) -> T:
    """``first`` awaited in turn, then ``then``; none of the rest if one raises."""
    pending = collections.deque(first)
    try:
        while pending:
            await pending.popleft()
    except BaseException:
        for coro in (*pending, then):
            coro.close()
        raise
    return await then


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


# Settings an AsyncConnection changes with a coroutine, not an attribute.
_ASYNC_SETTERS = {
    "autocommit": "set_autocommit",
    "isolation_level": "set_isolation_level",
    "read_only": "set_read_only",
    "deferrable": "set_deferrable",
}


class ResultNotHere(psycopg.NotSupportedError):
    """A handler read a property of a result that has not arrived (pipeline mode)."""


# Connections on which a handler read such a property: its batch fails even if the
# handler caught the error (``AsyncInboxStore.session``), and is applied again one
# by one without pipelining, where the property is right.
_READ_TOO_EARLY: weakref.WeakSet[psycopg.AsyncConnection[Any]] = weakref.WeakSet()


class AsyncPipelinedCursor(psycopg.AsyncCursor[Row]):
    """The cursor handed to async handlers.  In pipeline mode ``await fetch*()``
    waits for its result, as without it; a property of the result (``rowcount``,
    ``statusmessage``, ``description``, ``rownumber``) cannot be awaited, so reading
    one before its result arrived fails the batch instead of giving a wrong value
    (``ResultNotHere``): the batch is applied again one by one, without
    pipelining, where it is right; a batch that succeeds so turns pipelining off
    for the process (``loop.Processor._batch``)."""

    def _result(self, what: str) -> None:
        # ``_execmany_returning`` (private: False while an executemany() without
        # returning=True runs, whose results psycopg discards) has no public
        # equivalent; .ci/matrix runs this cursor on the oldest and newest psycopg
        # allowed (tests/integration/inbox/test_async_handlers.py).
        if (
            self.connection.pgconn.pipeline_status != PipelineStatus.OFF
            and self._execmany_returning is not False
            and not self.pgresult
        ):
            _READ_TOO_EARLY.add(self.connection)
            raise ResultNotHere(
                f"cursor.{what} was read before its statement's result arrived "
                "(pipeline mode); the batch is applied again without pipelining"
            )

    @property
    def rowcount(self) -> int:
        self._result("rowcount")
        return super().rowcount

    @property
    def statusmessage(self) -> str | None:
        self._result("statusmessage")
        return super().statusmessage

    @property
    def description(self) -> list[Column] | None:
        self._result("description")
        return super().description

    @property
    def rownumber(self) -> int | None:
        self._result("rownumber")
        return super().rownumber


class LoopCursor:
    """What ``InboxStore`` reads of a statement's result.  Its rows come with the
    statement's own hop (``LoopConnection.execute``), or, in a pipeline block, with
    the hop that ends the block (``LoopConnection.pipeline``)."""

    def __init__(
        self,
        bridge: Bridge,
        cursor: psycopg.AsyncCursor[Any] | None = None,
        rows: list[Any] | None = None,
    ) -> None:
        self._bridge, self._cursor, self._rows = bridge, cursor, rows

    def fetchone(self) -> Any:
        if self._rows is not None:
            return self._rows.pop(0) if self._rows else None
        return self._bridge.run(self._sent().fetchone())

    def fetchall(self) -> list[Any]:
        if self._rows is not None:
            rows, self._rows = self._rows, []
            return rows
        return self._bridge.run(self._sent().fetchall())

    @property
    def rowcount(self) -> int:
        return self._sent().rowcount

    def _sent(self) -> psycopg.AsyncCursor[Any]:
        if self._cursor is None:
            raise RuntimeError("a statement of a pipeline block was read before the block ended")
        return self._cursor

    def settle(self, cursor: psycopg.AsyncCursor[Any], rows: list[Any]) -> None:
        self._cursor, self._rows = cursor, rows


async def _rows(cursor: psycopg.AsyncCursor[Any]) -> list[Any]:
    """A statement's rows once its result is here ([] if it returns none)."""
    result = cursor.pgresult
    return await cursor.fetchall() if result is not None and result.status == TUPLES_OK else []


class LoopConnection:
    """The synchronous face of an ``AsyncConnection`` that ``InboxStore`` drives from
    the consumer's thread: every statement is awaited on the application's loop.
    Anything else (``closed``, ``broken``, ``pgconn``, ``info``, the settings) is
    the ``AsyncConnection``'s own."""

    def __init__(self, aconn: psycopg.AsyncConnection[Any], bridge: Bridge) -> None:
        object.__setattr__(self, "aconn", aconn)
        object.__setattr__(self, "_bridge", bridge)
        object.__setattr__(self, "_queued", None)
        object.__setattr__(self, "_end_later", False)

    aconn: psycopg.AsyncConnection[Any]
    _bridge: Bridge
    # In a pipeline block: the store's statements, sent when the block ends.
    _queued: list[tuple[Any, Any, LoopCursor]] | None
    # The block ends in the next hop (``end_later``).
    _end_later: bool

    def end_later(self) -> None:
        """End the pipeline block in progress at the start of the next hop (the
        COMMIT's, ``AsyncInboxStore.commit_unless``) instead of in a hop of its
        own; the block's cursors are read in that hop."""
        object.__setattr__(self, "_end_later", True)

    def execute(self, query: Any, params: Any = None) -> LoopCursor:
        if self._queued is not None:
            face = LoopCursor(self._bridge)
            self._queued.append((query, params, face))
            return face

        async def executed() -> tuple[psycopg.AsyncCursor[Any], list[Any]]:
            cursor = await self.aconn.execute(query, params)
            return cursor, await _rows(cursor)  # here already: read in this hop

        cursor, rows = self._bridge.run(executed())
        return LoopCursor(self._bridge, cursor, rows)

    @contextlib.contextmanager
    def pipeline(
        self, *, entered: bool = False, first: Sequence[tuple[Any, Any]] = ()
    ) -> Iterator[list[LoopCursor]]:
        """Pipeline mode on the ``AsyncConnection`` for the block.  The store's
        statements in the block are sent when it ends, in the hop that leaves
        pipeline mode (its sync: their results, or the first error) and reads
        their rows: a block of statements is one hop.  ``entered``: pipeline mode
        from the start of the block, for handlers awaited in it (their statements
        do not wait for their results; the store's go after them), and ``first``
        sent in the hop that enters it, ahead of the handlers'.  That hop is the
        block's first (``Bridge.defer``): the handlers run ahead in it.  Gives the
        cursors of ``first``, read once the block has ended."""
        _READ_TOO_EARLY.discard(self.aconn)
        block = self.aconn.pipeline()
        faces = [LoopCursor(self._bridge) for _ in first]
        queued: list[tuple[Any, Any, LoopCursor]] = []
        sent: list[tuple[psycopg.AsyncCursor[Any], LoopCursor]] = []
        inside: list[bool] = []  # [True] once pipeline mode is entered

        async def enter() -> None:
            cursors = await self._entered(block, first)
            sent.extend(zip(cursors, faces, strict=True))
            inside.append(True)

        if entered:
            self._bridge.defer(enter())
        else:
            queued.extend(
                (query, params, face) for (query, params), face in zip(first, faces, strict=True)
            )
        object.__setattr__(self, "_queued", queued)
        object.__setattr__(self, "_end_later", False)
        try:
            yield faces
        except BaseException as exc:
            object.__setattr__(self, "_queued", None)
            object.__setattr__(self, "_end_later", False)
            self._bridge.drop_deferred()
            if inside:
                self._bridge.run(block.__aexit__(type(exc), exc, exc.__traceback__))
            raise
        object.__setattr__(self, "_queued", None)
        ending = self._ended(block, queued, sent, entered=entered)
        if self._end_later:
            object.__setattr__(self, "_end_later", False)
            self._bridge.defer(ending)
        else:
            self._bridge.run(ending)

    async def _entered(
        self, block: contextlib.AbstractAsyncContextManager[Any], first: Sequence[tuple[Any, Any]]
    ) -> list[psycopg.AsyncCursor[Any]]:
        await block.__aenter__()
        try:
            return [await self.aconn.execute(query, params) for query, params in first]
        except BaseException as exc:
            await block.__aexit__(type(exc), exc, exc.__traceback__)
            raise

    async def _ended(
        self,
        block: contextlib.AbstractAsyncContextManager[Any],
        queued: list[tuple[Any, Any, LoopCursor]],
        sent: list[tuple[psycopg.AsyncCursor[Any], LoopCursor]],
        *,
        entered: bool,
    ) -> None:
        if not entered:
            await block.__aenter__()
        try:
            for query, params, face in queued:
                sent.append((await self.aconn.execute(query, params), face))
        except BaseException as exc:
            await block.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        await block.__aexit__(None, None, None)
        for cursor, face in sent:
            face.settle(cursor, await _rows(cursor))

    def cursor(self, **options: Any) -> LoopCursorMaker:
        """A cursor with ``options`` (``row_factory``, …) whose ``execute`` is
        awaited on the loop, as code written for a ``Connection`` uses it
        (``db.session.holders`` names what held a lock that timed out)."""
        return LoopCursorMaker(self, options)

    def close(self) -> None:
        """Closed on the loop; if the loop does not run, the session is ended from
        here (the socket closed), so that its transaction, holding inbox rows,
        does not outlive the consumer's giving it up."""
        try:
            self._bridge.run(self.aconn.close())
        except LoopNotRunning:
            self.aconn.pgconn.finish()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.aconn, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setter = _ASYNC_SETTERS.get(name)
        if setter is None:
            setattr(self.aconn, name, value)
        else:
            self._bridge.run(getattr(self.aconn, setter)(value))


class LoopCursorMaker:
    """``LoopConnection.cursor``: ``execute`` runs in one hop and brings the rows."""

    def __init__(self, conn: LoopConnection, options: dict[str, Any]) -> None:
        self._conn, self._options = conn, options

    def execute(self, query: Any, params: Any = None) -> LoopCursor:
        aconn = self._conn.aconn

        async def executed() -> tuple[psycopg.AsyncCursor[Any], list[Any]]:
            cursor = aconn.cursor(**self._options)
            await cursor.execute(query, params)
            return cursor, await _rows(cursor)

        cursor, rows = self._conn._bridge.run(executed())
        return LoopCursor(self._conn._bridge, cursor, rows)


class AsyncInboxStore(InboxStore):
    """``InboxStore`` on an ``AsyncConnection`` of the application's loop; the
    handler is handed that ``AsyncConnection``."""

    def __init__(
        self, settings: ConsumerSettings, bridge: Bridge, ahead: Ahead | None = None
    ) -> None:
        self._bridge = bridge
        self._ahead = ahead if ahead is not None else Ahead()
        super().__init__(
            settings.dsn,
            settings.inbox_table,
            settings.consumer,
            connect_timeout=settings.connect_timeout,
        )

    def _open(self) -> psycopg.Connection[Any]:
        async def opened() -> psycopg.AsyncConnection[Any]:
            options = connect_options(
                application_name=self._application_name, timeout=self._connect_timeout
            )
            try:
                aconn = await psycopg.AsyncConnection.connect(self._dsn, **options)
            except psycopg.OperationalError as exc:
                raise cannot_connect(exc) from exc
            aconn.row_factory = tuple_row  # handlers get psycopg's default rows
            aconn.cursor_factory = AsyncPipelinedCursor
            return aconn

        conn = LoopConnection(self._bridge.run(opened()), self._bridge)
        try:  # the lock_timeout (and statement_timeout) of the plain consumer's sessions
            bound_statements(
                cast("psycopg.Connection[Any]", conn), self.statement_timeout, self.lock_timeout
            )
        except psycopg.Error as exc:
            conn.close()
            raise DatabaseUnavailable(
                f"cannot configure the consumer's PostgreSQL session: {first_line(exc)}"
            ) from exc
        # InboxStore uses only what LoopConnection offers of a Connection.
        return cast("psycopg.Connection[Any]", conn)

    @property
    def connection(self) -> psycopg.AsyncConnection[Any]:  # type: ignore[override]
        """The ``AsyncConnection`` handed to handlers (the store's own session)."""
        return cast(LoopConnection, self.conn).aconn

    @property
    def pipelining(self) -> bool:
        return psycopg.AsyncPipeline.is_supported()

    def _connect(self) -> psycopg.Connection[Any]:
        conn = super()._connect()
        self._ahead.idle_timeout = self.idle_timeout
        return conn

    def session(self) -> SessionState:
        """The session as the handler call that just returned left it: read on the
        loop right after it if it ran ahead (``Ahead.shown``), else now."""
        shown, self._ahead.shown = self._ahead.shown, None
        return shown if shown is not None else loop_session(self.connection)

    def send_seal(self) -> Callable[[], datetime.datetime]:
        """``InboxStore.send_seal``; the block then ends in the COMMIT's hop."""
        sealed = super().send_seal()
        cast(LoopConnection, self.conn).end_later()
        return sealed

    def commit_unless(self, unless: Callable[[], str | None]) -> str | None:
        """``InboxStore.commit_unless`` in one hop: the pipeline block's end if it
        was left for it (``send_seal``), then ``unless()`` on the loop, then the
        COMMIT.  An error at the block's end is given as the reason, as the
        Processor takes it when the block ends on its own."""
        try:
            with self._translated("running the handlers' statements"):
                reason, refused = self._bridge.run(self._commit_unless(unless))
        except LoopNotRunning:
            raise  # nothing was sent: an outage, no message's failure
        except (DatabaseUnavailable, StatementRefused) as exc:
            return exc.message  # nothing was committed
        if refused is not None:
            with self._translated("committing"):
                raise refused
        return reason

    async def _commit_unless(
        self, unless: Callable[[], str | None]
    ) -> tuple[str | None, Exception | None]:
        reason = unless()
        if reason is not None:
            return reason, None
        try:
            await self.connection.execute("COMMIT")
        except Exception as exc:  # translated on the consumer's thread
            return None, exc
        return None, None

    @contextlib.contextmanager
    def pipeline(
        self, record: tuple[Sequence[str], Sequence[str]] | None = None
    ) -> Iterator[Callable[[], tuple[datetime.datetime, set[str]]] | None]:
        """``InboxStore.pipeline``, in pipeline mode from the start (the handlers run
        in it); ``record``'s statements go in the hop that enters it, and the
        block ends in the COMMIT's hop once the seal is sent (``send_seal``)."""
        conn = cast(LoopConnection, self.conn)
        first = self._recording(*record, ahead=True) if record is not None else []
        try:
            with (
                self._translated("running the handlers' statements"),
                conn.pipeline(entered=True, first=first) as faces,
            ):
                yield self._recorded(faces) if record is not None else None
        finally:  # no handler call of this transaction comes after the block
            self._ahead.clear()


def loop_session(aconn: psycopg.AsyncConnection[Any]) -> SessionState:
    """``store.session_state``, and a handler that caught ``ResultNotHere`` left
    its transaction as good as aborted."""
    state = session_state(aconn)
    if aconn in _READ_TOO_EARLY:
        return state._replace(transaction="inerror")
    return state


class RanTooLong(OutboxError):
    """A handler run ahead in a pipelined batch outlived the session's
    ``idle_in_transaction_session_timeout`` (which PostgreSQL does not apply while
    statements are in flight): its batch fails, as ``steps.Processor`` fails it
    when the handler runs on its own."""


@dataclasses.dataclass(frozen=True)
class Called:
    """One handler call run ahead: what it raised, the session right after it,
    and how long it took on the loop."""

    message: InboxMessage
    raised: BaseException | None
    state: SessionState
    seconds: float


class Ahead:
    """The calls of a pipelined batch run ahead on the loop (``AwaitedHandler
    .outbox_run_ahead``), taken one per ``Processor`` call in order; shared by the
    handler's face and the store, cleared when the batch's pipeline block ends."""

    def __init__(self) -> None:
        self.calls: collections.deque[Called] = collections.deque()
        self.shown: SessionState | None = None  # for the store's next ``session()``
        self.idle_timeout: float | None = None  # the store's session's, seconds

    def clear(self) -> None:
        self.calls.clear()
        self.shown = None


class AwaitedHandler:
    """What ``steps.Processor`` calls on the consumer's thread for an async handler.

    A call alone is one hop: the handler awaited on the application's loop, the
    thread waiting for it.  In a pipelined batch the Processor first hands over the
    batch (``outbox_run_ahead``): the handler is awaited for each message in turn on the
    loop in ONE hop, stopping at the first that fails as the Processor would fail
    it (raises, leaves the session as ``steps.handler_left`` forbids, or outlives
    the idle timeout), each call's session read on the loop right after it.  The
    Processor's calls then take those outcomes in order without a hop, and its
    checks see each call's own session (``AsyncInboxStore.session``).  Calls after
    one the Processor stops at ran in the same transaction, which it rolls back
    (a handler may run more than once; its effects commit once)."""

    def __init__(self, handler: Callable[..., Any], bridge: Bridge, ahead: Ahead) -> None:
        self.handler, self.bridge, self.ahead = handler, bridge, ahead
        self.outbox_took: float | None = None  # the last call's time on the loop, if run ahead

    def __call__(self, conn: Any, message: InboxMessage) -> None:
        self.outbox_took = None
        ahead = self.ahead
        if ahead.calls:
            called = ahead.calls.popleft()
            if called.message is not message:  # not the batch handed over: fail it
                ahead.clear()
                raise RuntimeError("the consumer called a handler out of its batch's order")
            self.outbox_took = called.seconds
            if called.raised is not None:
                raise called.raised
            ahead.shown = called.state
            return
        raised = self.bridge.run(self._once(conn, message))
        if raised is not None:
            raise raised

    async def _once(self, conn: Any, message: InboxMessage) -> BaseException | None:
        return await _call_handler(self.handler, conn, message)

    def outbox_run_ahead(self, conn: Any, messages: list[InboxMessage]) -> None:
        self.ahead.clear()
        before = loop_session(conn)
        self.ahead.calls.extend(self.bridge.run(self._ahead(conn, messages, before)))

    async def _ahead(
        self, conn: Any, messages: list[InboxMessage], before: SessionState
    ) -> list[Called]:
        """The batch's calls in one task of their own (one task a batch, not one a
        call: ``_call_handler`` says why a task of their own).  A handler that
        cancels that task ends it cancelled: its call is the one in progress, its
        message's failure, and the batch stops there as at any failure."""
        calls: list[Called] = []
        current: list[tuple[InboxMessage, float]] = []
        run = asyncio.ensure_future(self._calls(conn, messages, before, calls, current))
        try:
            await asyncio.wait((run,))
        except asyncio.CancelledError:
            run.cancel()
            await asyncio.wait((run,))
            raise
        if run.cancelled() and current:
            message, started = current[-1]
            calls.append(
                Called(
                    message,
                    _cancelled(),
                    loop_session(conn),
                    time.perf_counter() - started,
                )
            )
        elif not run.cancelled():
            run.result()
        return calls

    async def _calls(
        self,
        conn: Any,
        messages: list[InboxMessage],
        before: SessionState,
        calls: list[Called],
        current: list[tuple[InboxMessage, float]],
    ) -> None:
        idle = self.ahead.idle_timeout
        for message in messages:
            started = time.perf_counter()
            current.append((message, started))
            raised = await _outcome(self.handler, conn, message)
            current.pop()
            if raised is None and await _cancelled_itself():
                # It cancelled the task and returned before the cancel took effect.
                raised = _cancelled()
            seconds = time.perf_counter() - started
            if raised is None and idle and seconds >= idle:
                raised = RanTooLong(
                    f"the handler ran longer than the session's "
                    f"idle_in_transaction_session_timeout ({idle:g} s)"
                )
            state = loop_session(conn)
            calls.append(Called(message, raised, state, seconds))
            if raised is not None or handler_left(before, state, pending=True):
                break


class HandlerCancelled(Exception):
    """The handler's own task was cancelled: it cancelled itself
    (``asyncio.current_task().cancel()``, then returned or awaited) or raised
    ``CancelledError``.  Its message's failure, as anything it raises."""


class NotRun(Exception):
    """What the handler returned shows that code of it never ran (``steps.not_run``):
    its message's failure."""


async def _call_handler(
    handler: Callable[..., Any], conn: Any, message: InboxMessage
) -> BaseException | None:
    """Await ``handler(conn, message)`` in a task of its own; what it raised, or None.

    Its own task is what tells a handler that cancels itself from a cancellation
    of the consumer's hop by the application (a shutdown cancelling every task),
    the same way on every Python the package supports (3.10 has no
    ``Task.cancelling()``): the first ends the handler's task cancelled, and is
    its message's failure (``HandlerCancelled``); the second raises
    ``CancelledError`` here, at the wait, and the handler's task is cancelled
    with it and waited for (the session is not used again under it).  Sharing
    the hop's task, a handler that cancels it and returns ended the whole hop:
    a batch's other calls, the consumer with it."""
    call = asyncio.ensure_future(_outcome(handler, conn, message))
    try:
        await asyncio.wait((call,))
    except asyncio.CancelledError:
        call.cancel()
        await asyncio.wait((call,))
        raise
    if call.cancelled():
        return _cancelled()
    return call.result()


# Python 3.11 and later: a task says whether a cancellation is pending.
_CANCELLING = hasattr(asyncio.Task, "cancelling")


async def _cancelled_itself() -> bool:
    """Whether the call that just returned cancelled the running task (its batch's
    task, which nothing else cancels but ``_ahead`` in answer to the hop's own
    cancellation).  On 3.10, which cannot tell, one turn of the loop lets the
    cancellation in."""
    if _CANCELLING:
        task = asyncio.current_task()
        return task is not None and task.cancelling() > 0
    try:
        await asyncio.sleep(0)
    except asyncio.CancelledError:
        return True
    return False


def _cancelled() -> HandlerCancelled:
    return HandlerCancelled(
        "the handler's task was cancelled (asyncio.CancelledError): a handler must "
        "return or raise; to give up on a message, raise an exception"
    )


async def _outcome(
    handler: Callable[..., Any], conn: Any, message: InboxMessage
) -> BaseException | None:
    try:
        returned = await handler(conn, message)
    except asyncio.CancelledError:
        raise  # the task ends cancelled, as when the handler cancels it and returns
    except BaseException as exc:
        # Its message's failure (the BaseException policy in ``steps``), raised on
        # the consumer's thread.  Returned, not raised: asyncio lets SystemExit and
        # KeyboardInterrupt out of a task into the loop's runner, which they end.
        return exc
    why = None if returned is None else not_run(returned)
    return None if why is None else NotRun(why)


def async_inbox(
    handler: Callable[..., Any], settings: ConsumerSettings, loop: asyncio.AbstractEventLoop
) -> Inbox:
    """An ``Inbox`` whose handler is awaited on ``loop`` with the ``AsyncConnection``
    its transaction runs on; run it with ``run_async`` on that loop."""
    if not is_async(handler):
        raise HandlerNotFound(
            f"{getattr(handler, '__name__', handler)!r} is not an async def function",
            "pass it to outbox.inbox.consume instead",
        )
    bridge, ahead = Bridge(loop), Ahead()
    face: Handler = AwaitedHandler(handler, bridge, ahead)
    return Inbox(face, settings, connect_store=lambda s: AsyncInboxStore(s, bridge, ahead))


async def run_async(inbox: Inbox) -> ConsumerStats:
    """Run ``inbox`` (from ``async_inbox``) on a thread until it stops or the task
    awaiting this is cancelled; both servers' connections are closed on return."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[ConsumerStats] = loop.create_future()

    def settle(outcome: ConsumerStats | BaseException) -> None:
        if done.done():
            return
        if isinstance(outcome, BaseException):
            done.set_exception(outcome)
        else:
            done.set_result(outcome)

    def work() -> None:
        outcome: ConsumerStats | BaseException
        try:
            inbox.start()
            outcome = inbox.run()
        except BaseException as exc:  # handed to the awaiting task as it is
            outcome = exc
        finally:
            # Closed before the task learns the outcome: its loop may end right after.
            with contextlib.suppress(Exception):
                inbox.close()
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=work, name="outbox-consume-async", daemon=True).start()
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        # Take no more messages; the one in hand ends (committed and acked, or
        # rolled back) and the connections close, on this loop, before we go.
        # A second cancellation stops waiting for that.
        inbox.stop()
        with contextlib.suppress(Exception):
            await asyncio.shield(done)
        raise


async def consume_async(
    handler: AsyncHandler,
    *,
    queue: str,
    dsn: str = DEFAULT_DSN,
    amqp_url: str = DEFAULT_AMQP_URL,
    **options: Any,
) -> ConsumerStats:
    """Consume ``queue`` with exactly-once effects from inside a running event loop
    until the awaiting task is cancelled.

    ``await handler(conn, message)`` runs inside the transaction that records the
    message id, on ``conn``, a psycopg ``AsyncConnection``; it must not commit.
    ``options`` are ``ConsumerSettings`` fields."""
    settings = ConsumerSettings(queue=queue, dsn=dsn, amqp_url=amqp_url, **options)
    return await run_async(async_inbox(handler, settings, asyncio.get_running_loop()))
