"""The fleet: one process that relays every database of a list (``outbox relay --targets``).

Design: one process, one thread per target, each thread running the relay of one
database (``outbox.relay.process.Relay`` with the target's DSN: its own sessions and
its own RabbitMQ connection), and a supervisor (``Fleet.run``, the main thread) that
starts and stops target threads as the list changes (``TargetSource.poll``, every
``interval``).  Every relay of a fleet serves every target; the databases arbitrate
between fleets as between relays (SKIP LOCKED, the relays table, advisory locks):
there is no coordinator, and a second fleet process is the failover.

Why threads: a relay waits (on its sockets) almost all the time, and its CPU is
spent in psycopg and pika with the GIL released around the I/O; a process per
database costs an interpreter each, a thread a stack.  Idle databases cost one
PostgreSQL session each once dormant (``dormant_after``: the fleet's default is
``DORMANT_AFTER`` seconds; ``outbox.relay.process``).  Measured with
``python -m outbox.fleet.footprint --databases 50 --seconds 30`` (``--seconds 90``
for the last line) on a 2-core machine shared with other work (load average 15-29),
50 idle databases, default settings:

==========================================  ========  =======  ==================
relays                                      sessions  RSS      CPU (of one core)
==========================================  ========  =======  ==================
50 ``outbox relay --dsn`` processes         150       2367 MiB 2.90%
one fleet, ``--dormant-after 0``            150       66 MiB   2.43%
one fleet, dormant, first version (a 1 s    50        66 MiB   2.10%
tick and a poll every 5 s per target)
one fleet, dormant, as now (no tick, one    50        66 MiB   1.07% (90 s)
statement per 30 s per target)
==========================================  ========  =======  ==================

An asyncio loop would save the threads' stacks, not the sessions (one per idle
database either way) nor the statements, and would need an async relay beside the
one every promise is tested on; a process per database costs 36 times the memory.

A target's life (``TargetRelay``):

- ``starting``: ``Relay.start`` connects and checks the database and the broker.  A
  target that cannot start (down, refusing: prepared transactions disabled, no
  outbox table, a wrong password, a database that does not exist, a schema too
  new) is logged (``fleet.target_failed`` with the error and its hint), retried
  after ``RETRY_INITIAL`` seconds, doubling to ``RETRY_MAX``, and never stops the
  others;
- ``serving`` (or ``dormant``): ``Relay.run``, which retries outages itself;
- an unexpected exception out of the relay is logged with its traceback
  (``fleet.target_crashed``) and the target started again after the same backoff:
  never a dead thread nobody notices;
- removed from the list (or the fleet stopping): its ``StopFlag`` is set, the relay
  finishes its batches in flight, unregisters and closes (``fleet.target_stopped``).

Every event a target's threads emit carries ``database=<name>``
(``outbox.events.context``; the heartbeat thread takes it over).  A targets file
that cannot be read is logged (``fleet.targets_unreadable``) and the fleet keeps
the targets it has.  SIGTERM stops every target as above (exit 0); with ``drain``
the fleet exits once every target has drained (a target that cannot start never
drains: the fleet then runs until stopped).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import traceback
from collections.abc import Callable

from outbox.config import Settings
from outbox.errors import InvalidSetting, OutboxError
from outbox.events import context, emit
from outbox.fleet.targets import Target, TargetSource, diff
from outbox.relay.process import Relay, Stats, StopFlag

log = logging.getLogger("outbox.fleet")

# A fleet's default ``dormant_after`` (seconds): an idle target keeps one session.
DORMANT_AFTER = 30.0
# A target that fails to start is tried again after this, doubling up to RETRY_MAX.
RETRY_INITIAL = 5.0
RETRY_MAX = 60.0
# How often the supervisor looks at its threads (seconds).
SUPERVISOR_TICK = 0.5
# How long a stopping target may take to finish its batches (seconds), past which
# the fleet exits anyway (its prepared batches, if any, are left to resolvers).
STOP_GRACE = 120.0

STARTING, SERVING, DORMANT, RETRYING, STOPPED = (
    "starting",
    "serving",
    "dormant",
    "retrying",
    "stopped",
)


class TargetRelay:
    """One target's thread: its relay, started again whenever it fails."""

    def __init__(
        self,
        target: Target,
        settings: Settings,
        *,
        drain: bool = False,
        retry_initial: float = RETRY_INITIAL,
        retry_max: float = RETRY_MAX,
        relay_factory: Callable[[Settings, StopFlag], Relay] | None = None,
    ) -> None:
        self.target = target
        self.settings = dataclasses.replace(settings, dsn=target.dsn)
        self.drain = drain
        self.retry_initial, self.retry_max = retry_initial, retry_max
        self.stop = StopFlag()
        self.relay: Relay | None = None
        self.phase = STARTING
        self.error: str | None = None
        self.drained = False
        self.stats = Stats()  # the counters of this target's relays that ended
        self._factory = relay_factory or (lambda s, stop: Relay(s, stop=stop))
        self.thread = threading.Thread(
            target=self._run, name=f"outbox-fleet-{target.name}", daemon=True
        )

    @property
    def name(self) -> str:
        return self.target.name

    @property
    def state(self) -> str:
        """starting, serving, dormant, retrying or stopped."""
        relay = self.relay
        if self.phase == SERVING and relay is not None and relay.dormant:
            return DORMANT
        return self.phase

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        with context(database=self.target.name):
            try:
                self._serve()
            finally:
                self.phase = STOPPED
                summary = self.stats.summary()
                emit(log, "fleet.target_stopped", published=summary["published"])

    def _serve(self) -> None:
        pause = self.retry_initial
        while not self.stop:
            relay = self._factory(self.settings, self.stop)
            self.relay = relay
            try:
                self.phase = STARTING
                relay.start()
                self.phase, self.error, pause = SERVING, None, self.retry_initial
                emit(log, "fleet.target_serving", relay=relay.relay_id)
                relay.run(drain=self.drain)
                self.drained = self.drain and not self.stop
                return
            except OutboxError as exc:
                fields = {"error": exc.message, "retry": f"{pause:g}s"}
                if exc.hint:
                    fields["hint"] = exc.hint
                emit(log, "fleet.target_failed", logging.WARNING, **fields)
                self.error = exc.message
            except Exception as exc:  # a bug: logged with its traceback, then restarted
                emit(
                    log,
                    "fleet.target_crashed",
                    logging.ERROR,
                    error=repr(exc),
                    retry=f"{pause:g}s",
                    traceback=traceback.format_exc(),
                )
                self.error = repr(exc)
            finally:
                self._closed(relay)
            self.phase = RETRYING
            self.stop.wait(pause)
            pause = min(pause * 2, self.retry_max)

    def _closed(self, relay: Relay) -> None:
        """Close what the relay left open (``run`` closes itself; a failed
        ``start`` does not) and keep its counters."""
        try:
            relay.close()
        except Exception as exc:  # closing must never kill the thread
            emit(log, "fleet.target_close_failed", logging.WARNING, error=repr(exc))
        add_stats(self.stats, relay.stats)


def add_stats(total: Stats, more: Stats) -> None:
    """Add ``more``'s counters to ``total`` (a target's relays, a fleet's targets)."""
    for field in (
        "batches_committed",
        "batches_rolled_back",
        "batches_resolved",
        "messages_published",
        "dead_letters",
        "scheduled_moved",
        "duplicates_possible",
        "reconnects",
    ):
        setattr(total, field, getattr(total, field) + getattr(more, field))
    total.slowest_claim = max(total.slowest_claim, more.slowest_claim)
    total.largest_claim = max(total.largest_claim, more.largest_claim)
    total.write_failures.update(more.write_failures)


class Fleet:
    """The supervisor: one ``TargetRelay`` per target of ``source``."""

    def __init__(
        self,
        source: TargetSource,
        settings: Settings,
        *,
        stop: StopFlag | None = None,
        drain: bool = False,
        retry_initial: float = RETRY_INITIAL,
        retry_max: float = RETRY_MAX,
        relay_factory: Callable[[Settings, StopFlag], Relay] | None = None,
    ) -> None:
        self.source = source
        self._factory = relay_factory
        self.settings = settings
        self.stop = stop if stop is not None else StopFlag()
        self.drain = drain
        self.retry_initial, self.retry_max = retry_initial, retry_max
        self.targets: dict[Target, TargetRelay] = {}
        self._leaving: list[TargetRelay] = []  # removed, finishing their batches
        self.stats = Stats()  # counters of targets that ended
        self.last_progress = time.monotonic()
        self._started = False

    def members(self) -> list[TargetRelay]:
        """The targets served now, by name."""
        return sorted(self.targets.values(), key=lambda t: t.name)

    def start(self) -> None:
        """Read the targets (an unreadable source fails here: a usage error) and start
        a thread for each."""
        self._started = True
        try:
            targets = self.source.poll()
        except OutboxError as exc:
            if self.source.file is None:
                raise
            raise InvalidSetting(
                exc.message,
                "give --targets a readable UTF-8 file with one PostgreSQL DSN per line",
            ) from None
        emit(
            log,
            "fleet.started",
            source=self.source.describe(),
            targets=len(self.source.current),
        )
        self._apply(targets or [])

    def run(self) -> Stats:
        """Supervise until stopped (or, with ``drain``, until every target drained);
        then stop every target and wait for them."""
        if not self._started:
            self.start()
        try:
            while not self.stop:
                self.last_progress = time.monotonic()
                self._poll()
                self._tend()
                if self.drain and self.targets and all(t.drained for t in self.targets.values()):
                    break
                self.stop.wait(SUPERVISOR_TICK)
        finally:
            self.close()
        return self.stats

    def _poll(self) -> None:
        try:
            targets = self.source.poll()
        except OutboxError as exc:
            emit(
                log,
                "fleet.targets_unreadable",
                logging.WARNING,
                error=exc.message,
                hint="the fleet keeps serving the targets it has and looks again",
            )
            return
        if targets is not None:
            self._apply(targets)

    def _apply(self, targets: list[Target]) -> None:
        changes = diff(self.targets, targets)
        for target in changes.removed:
            member = self.targets.pop(target)
            member.stop.set()
            self._leaving.append(member)
            emit(log, "fleet.target_removed", database=target.name)
        for target in changes.added:
            member = self._member(target)
            self.targets[target] = member
            member.start()
            emit(log, "fleet.target_added", database=target.name)

    def _member(self, target: Target) -> TargetRelay:
        return TargetRelay(
            target,
            self.settings,
            drain=self.drain,
            retry_initial=self.retry_initial,
            retry_max=self.retry_max,
            relay_factory=self._factory,
        )

    def _tend(self) -> None:
        """Collect the removed targets that finished; restart a thread that ended
        while its target is still listed (it must not: its loop catches every
        exception, but a thread must never die silently)."""
        for member in [m for m in self._leaving if not m.thread.is_alive()]:
            self._leaving.remove(member)
            add_stats(self.stats, member.stats)
        for target, member in list(self.targets.items()):
            if member.thread.is_alive() or member.drained or member.stop:
                continue
            emit(log, "fleet.target_thread_ended", logging.ERROR, database=target.name)
            add_stats(self.stats, member.stats)
            replacement = self._member(target)
            self.targets[target] = replacement
            replacement.start()

    def close(self) -> None:
        """Stop every target; wait (``STOP_GRACE`` at most) for their batches in flight."""
        members = [*self.targets.values(), *self._leaving]
        for member in members:
            member.stop.set()
        deadline = time.monotonic() + STOP_GRACE
        for member in members:
            member.thread.join(max(0.0, deadline - time.monotonic()))
            if member.thread.is_alive():
                emit(log, "fleet.target_stop_timeout", logging.WARNING, database=member.name)
            add_stats(self.stats, member.stats)
        self.targets.clear()
        self._leaving.clear()
