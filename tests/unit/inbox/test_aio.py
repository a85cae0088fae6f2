"""``outbox.inbox.aio`` without servers: the bridge between the consumer's thread and
the application's loop, and which handlers take the async path."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from outbox.errors import DatabaseUnavailable
from outbox.inbox.aio import (
    Ahead,
    AwaitedHandler,
    Bridge,
    HandlerCancelled,
    LoopNotRunning,
    is_async,
)


async def double(x: int) -> int:
    return 2 * x


def plain(conn: Any, message: Any) -> None:
    pass


class AsyncCall:
    async def __call__(self, conn: Any, message: Any) -> None:
        pass


def test_is_async__coroutine_functions_partials_and_async_callables() -> None:
    assert is_async(double) and is_async(functools.partial(double)) and is_async(AsyncCall())
    assert not is_async(plain) and not is_async(print)


def test_bridge__runs_on_the_loop_and_raises_there_what_was_raised_there() -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        bridge = Bridge(loop)

        async def where() -> int | None:
            return threading.get_ident()

        async def fail() -> None:
            raise ValueError("there")

        assert bridge.run(double(21)) == 42
        assert bridge.run(where()) == thread.ident
        with pytest.raises(ValueError, match="there"):
            bridge.run(fail())
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def test_bridge__a_deferred_step_runs_first_in_the_next_hop_and_its_failure_is_that_hops(
    recwarn: pytest.WarningsRecorder,
) -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    steps: list[str] = []
    hops: list[int] = []
    original = loop.call_soon_threadsafe

    def counted(*args: Any, **kwargs: Any) -> Any:
        hops.append(1)
        return original(*args, **kwargs)

    async def step(name: str, *, fail: bool = False) -> None:
        steps.append(name)
        if fail:
            raise ValueError(name)

    async def last() -> str:
        steps.append("last")
        return "done"

    try:
        bridge = Bridge(loop)
        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        bridge.defer(step("first"))
        bridge.defer(step("second"))
        assert bridge.run(last()) == "done"
        assert steps == ["first", "second", "last"] and len(hops) == 1
        bridge.defer(step("broken", fail=True))
        bridge.defer(step("never"))
        with pytest.raises(ValueError, match="broken"):
            bridge.run(last())
        assert steps[3:] == ["broken"]  # neither the rest nor the hop's own ran
        bridge.defer(step("dropped"))
        assert bridge.drop_deferred() and not bridge.drop_deferred()
        assert bridge.run(last()) == "done" and "dropped" not in steps
    finally:
        loop.call_soon_threadsafe = original  # type: ignore[method-assign]
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
    assert not [w for w in recwarn if "never awaited" in str(w.message)]


def test_bridge__refuses_to_wait_for_ever_on_a_stopped_loop_or_on_its_own_thread() -> None:
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(DatabaseUnavailable, match="not running"):
            Bridge(loop).run(double(1))  # nothing runs the loop: it would hang

        async def inside() -> None:
            with pytest.raises(DatabaseUnavailable, match="not running"):
                Bridge(loop).run(double(1))  # waiting here would block the loop itself

        loop.run_until_complete(inside())
    finally:
        loop.close()


def test_bridge__a_hop_on_a_loop_closed_under_it_ends_and_its_own_timeouts_stay_its_own() -> None:
    """A loop stopped while a hop's coroutine waits, then closed: the hop's task is
    gone for good, so the consumer's thread stops waiting (LoopNotRunning) instead
    of for ever.  A TimeoutError the coroutine raises itself is raised as such."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    bridge = Bridge(loop)
    started = threading.Event()

    async def waits() -> None:
        started.set()
        await asyncio.sleep(3600)

    async def times_out() -> None:
        raise TimeoutError("its own")

    with pytest.raises(TimeoutError, match="its own"):
        bridge.run(times_out())
    outcome: list[BaseException] = []

    def hop() -> None:
        try:
            bridge.run(waits())
        except BaseException as exc:
            outcome.append(exc)

    waiting = threading.Thread(target=hop, daemon=True)
    waiting.start()
    assert started.wait(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()
    waiting.join(timeout=10)
    assert not waiting.is_alive(), "the hop still waits on a closed loop"
    assert len(outcome) == 1 and isinstance(outcome[0], LoopNotRunning)


@pytest.fixture
def app_loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


def cancels_itself_and_returns() -> None:
    task = asyncio.current_task()
    assert task is not None
    task.cancel()


async def cancel_return(conn: Any, message: Any) -> None:
    cancels_itself_and_returns()


async def cancel_await(conn: Any, message: Any) -> None:
    cancels_itself_and_returns()
    await asyncio.sleep(0)


async def cancel_raise(conn: Any, message: Any) -> None:
    raise asyncio.CancelledError("gives up")


async def cancel_swallowed(conn: Any, message: Any) -> None:
    cancels_itself_and_returns()
    try:
        await asyncio.sleep(0)
    except asyncio.CancelledError:
        conn.append("went on")


@pytest.mark.parametrize("handler", [cancel_return, cancel_await, cancel_raise])
def test_awaited_handler__a_handler_cancelling_its_own_task_fails_its_call_only(
    app_loop: asyncio.AbstractEventLoop, handler: Any
) -> None:
    """Cancelling its own task, then returning, awaiting or raising ``CancelledError``:
    the call's failure (``HandlerCancelled``), raised to the consumer as anything a
    handler raises; the next call runs as usual."""
    bridge = Bridge(app_loop)
    face = AwaitedHandler(handler, bridge, Ahead())
    with pytest.raises(HandlerCancelled, match="the handler's task was cancelled"):
        face([], None)  # type: ignore[arg-type]
    went_on: list[str] = []
    AwaitedHandler(cancel_swallowed, bridge, Ahead())(went_on, None)  # type: ignore[arg-type]
    assert went_on == ["went on"]  # caught its own cancellation and returned: a success
    assert bridge.run(double(2)) == 4


def test_bridge__a_hop_cancelled_on_the_loop_is_an_outage_and_its_handler_ends_first(
    app_loop: asyncio.AbstractEventLoop,
) -> None:
    """The application cancels every task of its loop (a shutdown) while a handler
    runs: the handler's call is cancelled and ends before the hop does, and the
    consumer sees ``LoopNotRunning`` (an outage), not ``CancelledError``."""
    bridge = Bridge(app_loop)
    started, ended = threading.Event(), threading.Event()

    async def waits(conn: Any, message: Any) -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        finally:
            ended.set()

    outcome: list[BaseException] = []

    def call() -> None:
        try:
            AwaitedHandler(waits, bridge, Ahead())(None, None)  # type: ignore[arg-type]
        except BaseException as exc:
            outcome.append(exc)

    calling = threading.Thread(target=call, daemon=True)
    calling.start()
    assert started.wait(10)

    def shutdown() -> None:
        for task in asyncio.all_tasks(app_loop):
            task.cancel()

    app_loop.call_soon_threadsafe(shutdown)
    calling.join(timeout=10)
    assert ended.is_set()
    assert len(outcome) == 1 and isinstance(outcome[0], LoopNotRunning), outcome
    assert "cancelled" in outcome[0].message
    with pytest.raises(LoopNotRunning, match="cancelled"):
        bridge.run(cancel_await(None, None))  # any hop's own task cancelled on the loop
