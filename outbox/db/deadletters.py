"""The dead-letter table: list, retry (back into the outbox) and purge."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import errors as pgerrors

from outbox.config import Settings
from outbox.db import privileges
from outbox.db.session import Session
from outbox.errors import DatabaseRefused
from outbox.message import ORDERING_KEY_MAX_BYTES

Row = dict[str, Any]
Conn = psycopg.Connection[Row]


class DeadLetterStore(Session):
    """What ``outbox dead-letters`` reads and changes; each call is one transaction."""

    def __init__(
        self,
        dsn: str,
        table: str,
        *,
        connect_timeout: float = 10.0,
        statement_timeout: float = Settings.statement_timeout,
        lock_timeout: float = Settings.lock_timeout,
    ) -> None:
        super().__init__(
            dsn, table, "outbox-dead-letters", connect_timeout, statement_timeout, lock_timeout
        )

    def entries(self, limit: int) -> list[Row]:
        self.check_privileges(privileges.DEAD_LETTERS_LIST, "outbox dead-letters list")
        with self._translated("listing dead letters"):
            return self.conn.execute(self.queries["list_dead_letters"], {"limit": limit}).fetchall()

    def entry(self, row_id: int, most: int) -> Row | None:
        """One dead letter with the first ``most`` bytes of its payload (``payload_bytes``
        is its size) and headers (as JSON text), or None."""
        self.check_privileges(privileges.DEAD_LETTERS_LIST, "outbox web")
        with self._translated("reading a dead letter"):
            return self.conn.execute(
                self.queries["dead_letter"], {"row_id": row_id, "most": most}
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

    def retry(
        self,
        *,
        everything: bool,
        message_ids: Sequence[uuid.UUID] = (),
        row_ids: Sequence[int] = (),
        ordering_keys: Sequence[str] = (),
    ) -> list[Row]:
        """Move dead letters back into the outbox atomically; the (id, message_id,
        ordering_key) moved."""
        self.check_privileges(privileges.DEAD_LETTERS_RETRY, "outbox dead-letters retry")
        try:
            with self._translated("retrying dead letters"):
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
    ) -> list[Row]:
        """Delete dead letters failed more than ``older_than`` s ago; the (id, message_id)."""
        self.check_privileges(privileges.DEAD_LETTERS_PURGE, "outbox dead-letters purge")
        with self._translated("purging dead letters"):
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
