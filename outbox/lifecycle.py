"""The life of a long-running process, one copy for the relay and the consumer.

``serve`` is what ``outbox relay`` and an embedded ``Relay.serve()`` run, and what
``outbox consume`` and an embedded ``outbox.inbox.consume()`` run, so a process
behaves the same whichever started it:

1. serve ``/metrics``, ``/healthz`` and ``/readyz`` (``outbox.probes``) when a port
   is given (``PortUnavailable``, a usage error, before anything connects);
2. connect and check the servers (``start``);
3. put the start-up heap out of the garbage collector's reach and, for a relay,
   run the collector's youngest generation less often (``freeze_startup_heap``,
   ``collect_young_less_often``);
4. run until stopped; then close the endpoints and the process, whatever happened;
5. log the summary event (``relay.stopped``, ``consumer.summary``) with the
   process's counters.

Signal handlers and the log format are the caller's: the command installs and
configures them, an application that embeds a process keeps its own.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from outbox.events import emit
from outbox.probes import Endpoints

log = logging.getLogger("outbox.lifecycle")

_Stats = TypeVar("_Stats")


def serve(
    name: str,
    *,
    start: Callable[[], object],
    run: Callable[[], _Stats],
    close: Callable[[], object],
    endpoints: Callable[[], Endpoints] | None,
    stopped: str,
    summary: Callable[[_Stats], Mapping[str, Any]],
    young_objects: int | None = None,
) -> _Stats:
    """Run a process through its whole life (see the module's docstring): ``name``
    (relay, consumer) prefixes the ``.endpoints`` event, ``stopped`` names the summary
    event, ``young_objects`` (a relay's batch size) sets ``collect_young_less_often``.
    Returns what ``run()`` returned."""
    served = endpoints() if endpoints is not None else None
    try:
        if served is not None:
            served.start()
            emit(log, f"{name}.endpoints", address=served.address, port=served.port)
        start()
        freeze_startup_heap()
        if young_objects is not None:
            collect_young_less_often(young_objects)
        stats = run()
    finally:
        if served is not None:
            served.close()
        close()
    emit(log, stopped, **summary(stats))
    return stats


def freeze_startup_heap() -> None:
    """Put the objects a long-running process holds from start-up (modules, classes,
    connections) out of the garbage collector's reach (``gc.freeze``).

    The relay and the consumer keep them for life, and every full collection walked
    them all: about 45,000 objects, 8 ms on a quiet machine; one in the middle of a
    relay's latency run at 2,000 commits/s, on two busy cores, took 112 ms, a pause
    every message in flight waited out.  Objects created later are collected as
    before; a cycle frozen here is never freed, so garbage is collected first.
    """
    gc.collect()
    gc.freeze()


# Objects a relay allocates per row of a batch and keeps while the batch is in
# flight (the row, its message, its delivery, its confirm entry, ...), with room.
OBJECTS_PER_ROW = 10


def collect_young_less_often(batch_size: int) -> None:
    """Run the collector's youngest generation only once ``OBJECTS_PER_ROW`` x
    ``batch_size`` more objects live than after the last run (Python's default: 700).

    A relay allocates a few objects per row and frees them all by reference
    counting once their batch is committed: draining 20,000 rows left 22 objects
    for the collector, but at 700 it ran about ten times per batch of 1,000 only to
    walk the rows still in flight, 10-15% of the relay's CPU.  What a failed step
    leaves in reference cycles (its batch's rows, held by the traceback's frames)
    the relay collects itself, at once (``outbox.relay.process``).
    """
    young, *older = gc.get_threshold()
    gc.set_threshold(max(young, OBJECTS_PER_ROW * batch_size), *older)
