"""The dead-letter table: list, retry (back into the outbox) and purge."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
from psycopg import errors as pgerrors

from outbox.db import privileges
from outbox.db.queries import LISTED, search_terms
from outbox.db.session import OPERATOR_BOUNDS, Hints, OperatorBounds, Session
from outbox.errors import DatabaseRefused, RowsHeld
from outbox.message import ORDERING_KEY_MAX_BYTES

Row = dict[str, Any]
Conn = psycopg.Connection[Row]


# What an operator is told when ``outbox dead-letters`` (or the console) lost its
# session: each of its changes is one transaction, committed whole or not at all.
DEAD_LETTERS_SESSION_LOST = (
    "each change is one transaction, committed whole or not at all: run the command "
    "again (it is safe to; a dead letter already retried or purged is no longer listed); "
    "check the server if this repeats"
)


class DeadLetterStore(Session):
    """What ``outbox dead-letters`` reads and changes; each call is one transaction."""

    # An operator's command: the relay's hints ("the relay reconnects by itself")
    # would name a process that is not involved.
    hints = Hints.operator(DEAD_LETTERS_SESSION_LOST)

    def __init__(self, dsn: str, table: str, bounds: OperatorBounds = OPERATOR_BOUNDS) -> None:
        # Only operators (the CLI, the console) use it: bounded on the client too.
        super().__init__(
            dsn,
            table,
            "outbox-dead-letters",
            bounds.connect_timeout,
            bounds.statement_timeout,
            bounds.lock_timeout,
            client_deadline=True,
        )

    def entries(self, limit: int) -> list[Row]:
        self.check_privileges(privileges.DEAD_LETTERS_LIST, "outbox dead-letters list")
        with self._translated("listing dead letters"):
            return self.conn.execute(
                self.queries["list_dead_letters"], {**LISTED, "limit": limit}
            ).fetchall()

    def entry(self, row_id: int, most: int) -> Row | None:
        """One dead letter with the first ``most`` bytes of its payload (``payload_bytes``
        is its size) and headers (as JSON text), or None."""
        self.check_privileges(privileges.DEAD_LETTERS_LIST, "outbox web")
        with self._translated("reading a dead letter"):
            return self.conn.execute(
                self.queries["dead_letter"], {"row_id": row_id, "most": most}
            ).fetchone()

    def search(self, text: str, limit: int, offset: int) -> list[Row]:
        """A page of the dead letters whose row id is ``text`` or whose ids, reason,
        destination or key contain it (all of them for ""), each with the ``total``."""
        self.check_privileges(privileges.DEAD_LETTERS_LIST, "outbox web")
        with self._translated("searching dead letters"):
            return self.conn.execute(
                self.queries["search_dead_letters"],
                {**search_terms(text), **LISTED, "limit": limit, "offset": offset},
            ).fetchall()

    def groups(self, text: str, by: str, limit: int) -> list[Row]:
        """The same dead letters by ``reason`` or ``ordering_key``: label, count,
        oldest, first_id (a row of the group)."""
        with self._translated("grouping dead letters"):
            return self.conn.execute(
                self.queries["dead_letter_groups"],
                {
                    **search_terms(text),
                    **LISTED,
                    "by": "reason" if by == "reason" else "key",
                    "limit": limit,
                },
            ).fetchall()

    def sharing_reason(self, row_id: int, limit: int) -> list[int]:
        """The ids of the oldest ``limit`` dead letters with row ``row_id``'s reason."""
        with self._translated("selecting dead letters"):
            rows = self.conn.execute(
                self.queries["dead_letters_sharing_reason"], {"row_id": row_id, "limit": limit}
            ).fetchall()
        return [r["id"] for r in rows]

    def keys_of(self, row_ids: Sequence[int]) -> list[str]:
        """The ordering keys of these dead letters."""
        with self._translated("selecting dead letters"):
            rows = self.conn.execute(
                self.queries["dead_letter_keys"], {"row_ids": list(row_ids)}
            ).fetchall()
        return sorted(r["ordering_key"] for r in rows)

    def value(self, row_id: int, what: str, most: int) -> Row | None:
        """The ``size`` of one dead letter's ``payload`` or ``headers`` (as bytes), and
        the ``value`` itself if it has at most ``most`` bytes."""
        self.check_privileges(privileges.DEAD_LETTERS_LIST, "outbox web")
        with self._translated("reading a dead letter"):
            return self.conn.execute(
                self.queries["dead_letter_value"], {"row_id": row_id, "what": what, "most": most}
            ).fetchone()

    def matching(
        self,
        *,
        everything: bool = False,
        message_ids: Sequence[uuid.UUID] = (),
        row_ids: Sequence[int] = (),
        ordering_keys: Sequence[str] = (),
        limit: int = 100_000,
    ) -> list[Row]:
        """The dead letters ``retry`` or ``purge`` of this selection would take now
        (id, message_id, ordering_key, reason, failed_at), changing nothing."""
        self.check_privileges(privileges.DEAD_LETTERS_LIST, "outbox web")
        with self._translated("selecting dead letters"):
            return self.conn.execute(
                self.queries["select_dead_letters"],
                {
                    "all": everything,
                    "ids": list(message_ids),
                    "row_ids": list(row_ids),
                    "keys": list(ordering_keys),
                    "limit": limit,
                },
            ).fetchall()

    def held(
        self, *, row_ids: Sequence[int], ordering_keys: Sequence[str], into_outbox: bool
    ) -> list[Row]:
        """The dead letters of this selection an in-doubt batch holds (id, gid): the
        rows a retry (``into_outbox``) or a purge would wait for."""
        with self._translated("looking for in-doubt batches holding dead letters"):
            return self.conn.execute(
                self.queries["held_dead_letters"],
                {"row_ids": list(row_ids), "keys": list(ordering_keys), "into_outbox": into_outbox},
            ).fetchall()

    @contextlib.contextmanager
    def _not_waiting(
        self,
        lock_timeout: float | None,
        what: str,
        row_ids: Sequence[int],
        ordering_keys: Sequence[str],
        into_outbox: bool,
    ) -> Iterator[None]:
        """With ``lock_timeout``: ``RowsHeld`` naming the in-doubt batches that hold
        the selection, before acting, or if the action waits longer than that for a
        lock (a batch prepared in between, another session's transaction)."""
        if lock_timeout is None:
            yield
            return

        def refuse() -> None:
            holders = self.held(
                row_ids=row_ids, ordering_keys=ordering_keys, into_outbox=into_outbox
            )
            if holders or lock_waited:
                raise RowsHeld(sorted({r["gid"] for r in holders}), f"nothing was {what}")

        lock_waited = False
        refuse()
        try:
            with self.conn.transaction():
                self.conn.execute(
                    "SELECT set_config('lock_timeout', %s, true)",
                    [str(max(1, round(lock_timeout * 1000)))],
                )
                yield
        except pgerrors.LockNotAvailable:
            lock_waited = True
        if lock_waited:
            refuse()

    def retry(
        self,
        *,
        everything: bool,
        message_ids: Sequence[uuid.UUID] = (),
        row_ids: Sequence[int] = (),
        ordering_keys: Sequence[str] = (),
        lock_timeout: float | None = None,
    ) -> list[Row]:
        """Move dead letters back into the outbox atomically; the (id, message_id,
        ordering_key) moved.

        With ``lock_timeout`` (the console), rows held by an in-doubt batch or locked
        longer than that raise ``RowsHeld`` instead of waiting for the batch."""
        self.check_privileges(privileges.DEAD_LETTERS_RETRY, "outbox dead-letters retry")
        try:
            with (
                self._translated("retrying dead letters"),
                self._not_waiting(lock_timeout, "retried", row_ids, ordering_keys, True),
            ):
                return self.conn.execute(
                    self.queries["retry_dead_letters"],
                    {
                        "all": everything,
                        "ids": list(message_ids),
                        "row_ids": list(row_ids),
                        "keys": list(ordering_keys),
                    },
                ).fetchall()
        except DatabaseRefused as exc:
            cause = exc.__cause__
            if not (
                isinstance(cause, pgerrors.CheckViolation)
                and cause.diag.constraint_name == f"{self.table}_ordering_key_length"
            ):
                raise
            # A dead letter recorded before schema 0004 limited new rows' keys.
            raise DatabaseRefused(
                "a dead letter to retry has an ordering key longer than the "
                f"{ORDERING_KEY_MAX_BYTES:,} bytes an outbox row may have; nothing was retried",
                "retry the others by id, and purge that one (outbox dead-letters purge <id>) "
                "or re-enqueue its payload with a shorter key",
            ) from exc

    def purge(
        self,
        *,
        everything: bool,
        message_ids: Sequence[uuid.UUID] = (),
        row_ids: Sequence[int] = (),
        ordering_keys: Sequence[str] = (),
        older_than: float | None = None,
        lock_timeout: float | None = None,
    ) -> list[Row]:
        """Delete dead letters failed more than ``older_than`` s ago; the (id, message_id).
        ``lock_timeout`` as for ``retry``."""
        self.check_privileges(privileges.DEAD_LETTERS_PURGE, "outbox dead-letters purge")
        with (
            self._translated("purging dead letters"),
            self._not_waiting(lock_timeout, "purged", row_ids, ordering_keys, False),
        ):
            return self.conn.execute(
                self.queries["purge_dead_letters"],
                {
                    "all": everything,
                    "ids": list(message_ids),
                    "row_ids": list(row_ids),
                    "keys": list(ordering_keys),
                    "older_than": older_than,
                },
            ).fetchall()
