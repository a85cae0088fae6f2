"""One sampler for every open tab: the overview and the charts are read from the
database once per interval, whoever is looking, and kept in memory.

- **The overview** (``overview``): ``console.overview`` at most once per
  ``refresh_seconds``; every tab's refresh within that time gets the same copy (a
  tab used to cost a dozen queries every refresh: ten tabs, ten times that).
- **The charts** (``charts``): a background thread runs one statement per table
  every ``sample_seconds``, after reading the relays' saved claim front for an
  outbox table (``BatchStore.chart_sample``: the backlog and its oldest row's age
  counted from that front as ``outbox status`` counts them, so that a held MVCC
  horizon's dead rows are not read every 10 s; three figures the statistics system
  keeps anyway, and the age of the oldest transaction holding the horizon) and keeps
  the last hour of samples, about 360 per table at 10 s.  The thread starts with the
  application (or on its first request) and stops with it.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from outbox.config import Settings
from outbox.errors import OutboxError
from outbox.events import emit
from outbox.ops import status
from outbox.web import charts, console
from outbox.web.console import ConsoleConfig

log = logging.getLogger("outbox.web")

KEEP_SECONDS = (charts.MINUTES + 1) * 60


class Sampler:
    def __init__(self, config: ConsoleConfig, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._overview_lock = threading.Lock()
        self._overview: tuple[float, dict[str, Any]] | None = None
        self._samples: dict[str, collections.deque[charts.Sample]] = {}
        self._errors: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the overview --------------------------------------------------------------
    def overview(self) -> dict[str, Any]:
        """The overview as of at most ``refresh_seconds`` ago (read now if older)."""
        with self._overview_lock:  # one reader at a time; the others get its result
            now = time.monotonic()
            if self._overview and now - self._overview[0] < self.config.refresh_seconds:
                return self._overview[1]
            data = console.overview(self.config)
            self._overview = (time.monotonic(), data)
            return data

    # -- the charts ----------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, name="outbox-web-sampler", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception as exc:  # a bug must not stop the charts for good
                emit(log, "web.sample_failed", logging.ERROR, error=repr(exc))
            self._stop.wait(self.config.sample_seconds)

    def sample(self) -> None:
        """One sample of every table (one statement each, an outbox's after reading
        its saved front); a table that cannot be read keeps its error for the page,
        and is tried again next time."""
        for settings in self.config.outboxes:
            self._take(f"outbox:{settings.table}", functools.partial(_outbox_values, settings))
        for target in self.config.inboxes:
            self._take(f"inbox:{target.table}", functools.partial(_inbox_values, target))

    def _take(self, key: str, read: Callable[[], dict[str, float]]) -> None:
        try:
            values = read()
        except OutboxError as exc:
            with self._lock:
                first = key not in self._errors
                self._errors[key] = console.describe(exc)
            if first:
                emit(log, "web.sample_failed", logging.WARNING, table=key, error=exc.message)
            return
        now = self._clock()
        with self._lock:
            self._errors.pop(key, None)
            found = self._samples.setdefault(key, collections.deque())
            found.append(charts.Sample(now, values))
            while found and found[0].at < now - KEEP_SECONDS:
                found.popleft()

    def charts(self) -> list[dict[str, Any]]:
        """Per table: its title, its charts over the last hour, or why it has none."""
        now = self._clock()
        with self._lock:
            samples = {k: list(v) for k, v in self._samples.items()}
            errors = dict(self._errors)
        sections = []
        for kind, tables, specs in (
            ("outbox", [s.table for s in self.config.outboxes], charts.OUTBOX_CHARTS),
            ("inbox", [t.table for t in self.config.inboxes], charts.INBOX_CHARTS),
        ):
            for table in tables:
                key = f"{kind}:{table}"
                found = samples.get(key, [])
                sections.append(
                    {
                        "kind": kind,
                        "table": table,
                        "error": errors.get(key),
                        "samples": len(found),
                        "charts": charts.charts(found, specs, now) if found else [],
                    }
                )
        return sections


def _outbox_values(settings: Settings) -> dict[str, float]:
    store = status.open_reader(settings, application_name="outbox-web")
    try:
        row = store.chart_sample()
    finally:
        store.close()
    return {
        "backlog": float(row["backlog"]),
        "oldest_seconds": float(row["oldest_seconds"]),
        # Rows deleted from the outbox are published or dead-lettered.
        "published": float(row["deleted"]) - float(row["dead_lettered"]),
        "dead_lettered": float(row["dead_lettered"]),
        "dead_rows": float(row["dead_rows"]),
        "horizon_seconds": float(row["horizon_seconds"]),
    }


def _inbox_values(target: console.InboxTarget) -> dict[str, float]:
    store = console.parked_store(target)
    try:
        row = store.chart_sample()
    finally:
        store.close()
    return {
        "parked_now": float(row["parked_now"]),
        "applied": float(row["applied"]),
        "parked": float(row["parked"]),
    }
