"""The console over many databases (``outbox web --targets FILE`` or ``--discover
DSN``): an overview of every database, and each database's own pages under its
path prefix, ``/db/<name>/`` (``/db/orders/dead-letters?table=outbox``).

- ``Databases`` keeps the list (``outbox.fleet.targets.TargetSource``, looked at
  again at most every ``interval`` seconds, so a database added to the targets file
  appears without a restart; a list that cannot be read keeps the last one and says
  why on the overview);
- ``DatabasePrefix`` (ASGI middleware, inside ``site.Guard``: nothing is read before
  a request is authenticated) takes ``/db/<name>`` off the path and puts the target
  into the request's scope, where ``Site.outbox_of`` finds it: every existing page
  then works on that database, with its links under the same prefix
  (``Pages.render``'s ``db_root``).  A name that is not a target is a 404;
- the overview of every database is ``outbox status`` over the fleet
  (``outbox.ops.fleet.collect``: 8 databases at a time, each on a short session
  bounded by the timeouts, a database that cannot be read shown as such in its row),
  read at most once per ``refresh_seconds`` whoever is looking.

Sessions: the overview reads up to 8 databases at once, on top of the console's
``CALLS_AT_ONCE`` calls.  A database's overview has no charts (the chart sampler
reads its tables every 10 s, which for fifty databases is a standing cost nobody
asked for); the overview of every database is the fleet's chart.
"""

from __future__ import annotations

import threading
import time
from collections.abc import MutableMapping
from typing import Any

import anyio.to_thread
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from outbox.errors import OutboxError
from outbox.fleet.targets import Target, TargetSource
from outbox.ops import fleet
from outbox.web import console
from outbox.web.console import ConsoleConfig
from outbox.web.site import DB_PREFIX as PREFIX
from outbox.web.site import DB_SCOPE_KEY as SCOPE_KEY
from outbox.web.site import with_headers


class Databases:
    """The console's targets, and the overview of all of them (cached)."""

    def __init__(self, source: TargetSource, config: ConsoleConfig) -> None:
        self.source = source
        self.config = config
        self._lock = threading.Lock()
        self._error: str | None = None
        self._overview_lock = threading.Lock()
        self._overview: tuple[float, dict[str, Any]] | None = None
        self._database: dict[str, tuple[float, dict[str, Any]]] = {}

    def targets(self) -> list[Target]:
        """The current list (read again when due; the last one if it cannot be)."""
        with self._lock:
            try:
                self.source.poll()
                self._error = None
            except OutboxError as exc:
                self._error = console.describe(exc)
            return list(self.source.current)

    def find(self, path: str) -> tuple[Target, str] | None:
        """The target a ``/db/<name>/…`` path names and the rest of the path; None if
        the path has no such prefix.  Names may hold ``/`` (``host:port/database``):
        the longest name that matches wins."""
        if not path.startswith(PREFIX):
            return None
        rest = path[len(PREFIX) :]
        for target in sorted(self.targets(), key=lambda t: -len(t.name)):
            if rest == target.name or rest.startswith(target.name + "/"):
                return target, rest[len(target.name) :] or "/"
        return None

    def overview(self) -> dict[str, Any]:
        """Every database's status and a summary (``outbox status --targets``), as of
        at most ``refresh_seconds`` ago."""
        with self._overview_lock:
            now = time.monotonic()
            if self._overview and now - self._overview[0] < self.config.refresh_seconds:
                return self._overview[1]
            report = fleet.collect(
                self.targets(),
                self.config.outboxes[0],
                max_prepared_age=self.config.max_prepared_age,
                max_backlog_age=self.config.max_backlog_age,
            )
            masked = console.shown(report)
            # Names come from the configuration and make the links: as they are.
            for entry, raw in zip(masked["databases"], report["databases"], strict=True):
                entry["database"] = raw["database"]
            data = {"report": masked, "targets_error": self._error}
            self._overview = (time.monotonic(), data)
            return data

    def database_overview(self, target: Target) -> dict[str, Any]:
        """One database's overview (``console.overview`` of its outbox tables), as of
        at most ``refresh_seconds`` ago."""
        with self._overview_lock:
            now = time.monotonic()
            cached = self._database.get(target.name)
            if cached and now - cached[0] < self.config.refresh_seconds:
                return cached[1]
        data = console.overview(console.on_database(self.config, target.dsn))
        with self._overview_lock:
            self._database[target.name] = (time.monotonic(), data)
            names = {t.name for t in self.source.current}
            for gone in set(self._database) - names:
                del self._database[gone]
        return data


class DatabasePrefix:
    """Takes ``/db/<name>`` off a request's path and puts the target in its scope
    (``SCOPE_KEY``); a ``/db/`` path that names no target is answered 404."""

    def __init__(self, app: ASGIApp, databases: Databases) -> None:
        self.app = app
        self.databases = databases

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        found = await anyio.to_thread.run_sync(self.databases.find, scope["path"])
        if found is None:
            # Answered here: the application's error pages are inside this middleware.
            response = with_headers(
                PlainTextResponse(
                    "no such database among the console's targets: the overview at / lists them",
                    status_code=404,
                )
            )
            await response(scope, receive, send)
            return
        target, rest = found
        inner: MutableMapping[str, Any] = dict(scope)
        inner["path"] = rest
        inner[SCOPE_KEY] = target
        await self.app(inner, receive, send)
