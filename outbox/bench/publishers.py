"""N bare pika publishers sending in parallel: the broker's real ingest.

One bare publisher (``harness.bare_publish``) is one connection and one confirm
window; N relays are N of each.  So N relays are measured against N bare
publishers too, each in a process of its own (spawned: pika's I/O loop in threads
of one process would share one GIL and cap them), each with its own connection
and confirm window of ``--window``, publishing its share of the bodies
(``split_evenly``).  Each connects and enters confirm mode first, then waits at a
barrier for the others; the run is timed from the first publish of any to the
last confirm of all (``parallel_seconds``), and its CPU is the sum of the
publishers' (``time.process_time`` in each, connecting included, as the
in-process bare publisher's).  Benchmarks print figures; nothing here is a timed
assertion.
"""

from __future__ import annotations

import multiprocessing
import time
import uuid
from collections.abc import Sequence
from typing import Any

from outbox.bench.harness import Bench, Run, bare_publish_span, bench_body
from outbox.errors import OutboxError

# Seconds a publisher waits at the barrier for the others to be connected.
BARRIER_SECONDS = 60.0


def split_evenly(total: int, parts: int) -> list[range]:
    """``range(total)`` in ``parts`` consecutive slices whose lengths differ by one
    at most (the longer first); no slice is empty, so fewer than ``parts`` when
    ``total < parts``."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, not {parts}")
    count = min(parts, total)
    if count == 0:
        return []
    size, extra = divmod(total, count)
    slices = []
    first = 0
    for n in range(count):
        stop = first + size + (1 if n < extra else 0)
        slices.append(range(first, stop))
        first = stop
    return slices


def parallel_seconds(spans: Sequence[tuple[float, float]]) -> float:
    """From the first publish of any publisher to the last confirm of all, each
    span being (first publish, last confirm) on one clock."""
    if not spans:
        raise ValueError("no publisher's span")
    return max(end for _, end in spans) - min(start for start, _ in spans)


def publish_share(
    amqp_url: str,
    exchange: str,
    routing_key: str,
    share: range,
    payload: int,
    window: int,
    timeout: float,
    barrier: Any,
    results: Any,
) -> None:
    """One publisher (a process of its own): the bodies of ``share``; puts (first
    publish, last confirm, CPU seconds) on ``results`` (or the error, as text)."""
    try:
        bodies = [bench_body(i, payload) for i in share]
        ids = [str(uuid.uuid4()) for _ in share]
        cpu0 = time.process_time()
        start, end = bare_publish_span(
            amqp_url,
            exchange,
            routing_key,
            bodies,
            ids,
            window=window,
            timeout=timeout,
            ready=lambda: barrier.wait(BARRIER_SECONDS),
        )
        results.put((start, end, time.process_time() - cpu0))
    except Exception as exc:
        barrier.abort()  # the others must not wait for this one
        results.put(f"{type(exc).__name__}: {exc}")


def parallel_bare(bench: Bench, count: int, *, timeout: float = 300.0) -> Run:
    """``count`` bare publishers in parallel on ``--rows`` bodies (``bench``'s
    options and queue), the figure N relays are compared with."""
    o = bench.o
    shares = split_evenly(o.rows, count)
    context = multiprocessing.get_context("spawn")  # no fork of a threaded process
    barrier = context.Barrier(len(shares))
    results = context.Queue()
    bench.broker.purge()
    publishers = [
        context.Process(
            target=publish_share,
            args=(
                o.amqp_url,
                bench.broker.exchange,
                "bench.bare",
                share,
                o.payload,
                o.window,
                timeout,
                barrier,
                results,
            ),
            daemon=True,
        )
        for share in shares
    ]
    for publisher in publishers:
        publisher.start()
    outcomes: list[tuple[float, float, float]] = []
    errors: list[str] = []
    try:
        for _ in publishers:
            outcome = results.get(timeout=BARRIER_SECONDS + timeout + 30)
            if isinstance(outcome, str):
                errors.append(outcome)
            else:
                outcomes.append(outcome)
    finally:
        for publisher in publishers:
            publisher.join(timeout=10)
            if publisher.is_alive():
                publisher.kill()
    if errors:
        raise OutboxError(f"a bare publisher in parallel failed: {errors[0]}")
    seconds = parallel_seconds([(start, end) for start, end, _ in outcomes])
    cpu = sum(c for _, _, c in outcomes)
    run = Run(
        "parallel-bare", count, o.window, o.rows, seconds, bench.broker.depth(), cpu_seconds=cpu
    )
    bench.broker.purge()
    return run
