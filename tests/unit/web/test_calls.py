"""``outbox.web.site.Calls``: the console's blocking calls, each on a thread that ends
with it, never more than ``most`` at once, even when requests give up waiting."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from outbox.web.site import Calls


def call_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "outbox-web-call")


def no_call_thread_within(seconds: float) -> bool:
    """A call's thread ends just after it hands its result over: wait for that."""
    deadline = time.monotonic() + seconds
    while call_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return call_threads() == 0


def test_calls__no_more_than_most_at_once_and_no_thread_left_behind() -> None:
    running = 0
    most_seen = 0
    lock = threading.Lock()
    full = threading.Event()  # three ran at once: however slow the machine, they overlap

    def work(n: int) -> int:
        nonlocal running, most_seen
        with lock:
            running += 1
            most_seen = max(most_seen, running)
            if running == 3:
                full.set()
        full.wait(5)
        time.sleep(0.01)
        with lock:
            running -= 1
        return n * 2

    async def main() -> list[int]:
        calls = Calls(3)
        return await asyncio.gather(*(calls(work, n) for n in range(12)))

    assert asyncio.run(main()) == [n * 2 for n in range(12)]
    assert most_seen == 3
    assert no_call_thread_within(5)


def test_calls__an_error_reaches_the_request() -> None:
    def fail() -> None:
        raise LookupError("gone")

    async def main() -> None:
        await Calls(1)(fail)

    with pytest.raises(LookupError, match="gone"):
        asyncio.run(main())


def test_calls__a_request_that_gives_up_keeps_its_slot_until_the_call_ends() -> None:
    """Cancelled requests (a client that went away) free no slot early: a slow call
    still holds one, so the threads never outnumber ``most``."""
    release = threading.Event()
    started: list[float] = []

    def slow() -> None:
        release.wait(5)

    def quick() -> None:
        started.append(time.monotonic())

    async def main() -> float:
        calls = Calls(1)
        waiting = asyncio.create_task(calls(slow))
        await asyncio.sleep(0.05)
        waiting.cancel()
        later = asyncio.create_task(calls(quick))
        await asyncio.sleep(0.2)
        assert started == [] and call_threads() == 1  # the slow call still has the slot
        released = time.monotonic()
        release.set()
        await later
        return released

    released = asyncio.run(main())
    assert started and started[0] >= released
