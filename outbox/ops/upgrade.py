"""``outbox init``: create or upgrade the schema online (docs/how-to/upgrading.md).

``outbox.db.migrate`` never lets the application's INSERTs queue behind a DDL for
longer than its ``lock_timeout``; this module decides what to do while a step
waits.  Before the first change to an existing schema, and again whenever a step
waits for a lock that a batch of this outbox holds, a resolver pass finishes the
batches of relays that are gone (committed with the ledger's evidence, rolled back
without it), so an upgrade done the obvious way (stop the relays, migrate, start
the new ones) is not held up by a batch that a dead relay left prepared.  Whatever
still holds a lock is named in one line: the gid of a prepared batch and what
settles it, or the session that holds it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from outbox.config import Settings
from outbox.db import migrate, session
from outbox.errors import OutboxError
from resolver import is_ours, run_pass

# Least time between two resolver passes while a step waits (seconds).
RESOLVE_EVERY = 5.0
# Most time between two lines about the same wait (seconds).
SAY_EVERY = 10.0


@dataclasses.dataclass
class Upgrade:
    """One ``outbox init``: ``say`` gets each progress line."""

    settings: Settings
    say: Callable[[str], None]
    _last_resolve: float = -RESOLVE_EVERY
    _unsettled: str = ""  # why the last resolver pass could not run
    _last_said: tuple[object, float] = ("", 0.0)

    def run(self) -> tuple[int | None, int]:
        conn = session.connect(
            self.settings.dsn,
            application_name="outbox-init",
            connect_timeout=self.settings.connect_timeout,
            # The migration's own steps run under its lock_timeout (and without a
            # statement_timeout: an index build may take long); these bound the rest.
            statement_timeout=self.settings.statement_timeout,
            lock_timeout=self.settings.lock_timeout,
            client_deadline=True,
        )
        try:
            return migrate.migrate(
                conn, self.settings.table, on_blocked=self._blocked, before_changes=self._settle
            )
        finally:
            conn.close()

    def _settle(self) -> None:
        """One resolver pass: finish the batches of relays that are gone."""
        self._last_resolve = time.monotonic()
        try:
            results = run_pass(self.settings, application_name="outbox-init-resolve")
        except OutboxError as exc:
            self._unsettled = exc.message
            return
        self._unsettled = ""
        for result in results:
            if result.finished:
                self.say(
                    f"finished batch {result.gid!r} of a relay that is gone: "
                    f"{result.outcome.replace('_', ' ')} ({result.decision.why})"
                )

    def _ours(self, holder: migrate.Holder) -> bool:
        # A lock held by a prepared transaction of this database (pg_locks).
        return holder.gid is not None and is_ours(holder.gid, local=True, table=self.settings.table)

    def _blocked(self, blocked: migrate.Blocked) -> None:
        now = time.monotonic()
        if any(self._ours(h) for h in blocked.holders) and (
            now - self._last_resolve >= RESOLVE_EVERY
        ):
            self._settle()
        # The same wait (step, holders, reason) is said again only every SAY_EVERY.
        wait = (blocked.step, [(h.gid, h.pid) for h in blocked.holders], self._unsettled)
        said, when = self._last_said
        if wait != said or now - when >= SAY_EVERY:
            self._last_said = (wait, now)
            line = migrate.describe_wait(blocked, self.settings.table, self._unsettled)
            self.say(
                f"{line} (waited {blocked.waited:.0f} s, try {blocked.attempt}; "
                "the application's writes go on meanwhile)"
            )
