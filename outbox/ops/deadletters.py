"""``outbox dead-letters``: look at, retry and purge rows that could not be published.

A dead letter keeps everything needed to publish it again (destination, payload,
headers, the original row ``id``, ``message_id`` and ``created_at``) plus why it
failed.  ``retry`` moves rows back into the outbox in one statement, so a row is
always in exactly one of the two tables; consumers see the original
``message_id``.  Dead letters are selected by ``message_id`` (every row carrying
it: rows may share one), by row id, or by ordering key (every dead letter of the
key, which is how a key held back by a dead letter is released).
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Sequence
from typing import Any

from outbox.config import Settings
from outbox.db.deadletters import DeadLetterStore
from outbox.ops.quarantine import Kind, bounds_of
from outbox.terminal import cut

_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.IGNORECASE)
_MAX_ROW_ID = 2**63 - 1  # bigint
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_age(text: str) -> float:
    """Seconds in ``"90"``, ``"90s"``, ``"15m"``, ``"12h"``, ``"30d"`` or ``"2w"``."""
    match = _AGE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not an age: use a number with s, m, h, d or w (e.g. 30d)")
    return float(match[1]) * _UNIT_SECONDS[match[2].lower()]


@dataclasses.dataclass(frozen=True)
class Selection:
    """The dead letters named on the command line: by message_id, row id or key."""

    message_ids: tuple[uuid.UUID, ...] = ()
    row_ids: tuple[int, ...] = ()
    ordering_keys: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.message_ids or self.row_ids or self.ordering_keys)

    def not_found(self, touched: Sequence[dict[str, Any]]) -> list[str]:
        """The names that matched no dead letter among ``touched`` (id, message_id,
        ordering_key)."""
        messages = {r["message_id"] for r in touched}
        rows = {r["id"] for r in touched}
        keys = {r.get("ordering_key") for r in touched}
        return (
            [str(m) for m in self.message_ids if m not in messages]
            + [str(r) for r in self.row_ids if r not in rows]
            + [f"ordering key {k!r}" for k in self.ordering_keys if k not in keys]
        )


def parse_ids(texts: Sequence[str], ordering_keys: Sequence[str] = ()) -> Selection:
    """Each text is a message id (a UUID) or an outbox row id (a whole number).

    ValueError for what no row can hold: a number beyond bigint, a key with NUL.
    """
    message_ids: list[uuid.UUID] = []
    row_ids: list[int] = []
    for text in texts:
        if text.strip().isdigit():
            if int(text) > _MAX_ROW_ID:
                raise ValueError(f"{text!r} is not a row id (ids end at {_MAX_ROW_ID})")
            row_ids.append(int(text))
            continue
        try:
            message_ids.append(uuid.UUID(text))
        except ValueError:
            raise ValueError(
                f"{text!r} is not a message id (a UUID) or a row id (a whole number)"
            ) from None
    for key in ordering_keys:
        if "\x00" in key:
            raise ValueError(f"{key!r} is not an ordering key: PostgreSQL text holds no NUL")
    return Selection(tuple(message_ids), tuple(row_ids), tuple(ordering_keys))


def as_dict(row: dict[str, Any]) -> dict[str, Any]:
    """A dead letter as JSON-ready data (the payload itself stays in the database)."""
    return {
        "id": row["id"],
        "message_id": str(row["message_id"]),
        "exchange": row["exchange"],
        "routing_key": row["routing_key"],
        "ordering_key": row["ordering_key"],
        "reason": row["reason"],
        "reason_chars": row["reason_chars"],
        "attempts": row["attempts"],
        "failed_at": row["failed_at"].isoformat(),
        "created_at": row["created_at"],  # as PostgreSQL prints it: may be 'infinity'
        "gid": row["gid"],
        "content_type": row["content_type"],
        "payload_bytes": row["payload_bytes"],
    }


def render(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return "no dead letters"
    lines = []
    for row in rows:
        lines.append(
            f"{row['message_id']}  row {row['id']}  "
            f"failed {row['failed_at']:%Y-%m-%d %H:%M:%S%z}  "
            f"attempts={row['attempts']}  to exchange={row['exchange']!r} "
            f"routing_key={row['routing_key'][:80]!r}  {row['payload_bytes']} bytes"
            + (f"  ordering_key={row['ordering_key'][:80]!r}" if row["ordering_key"] else "")
        )
        lines.append(f"    reason: {cut(row['reason'], row['reason_chars'])}")
    return "\n".join(lines)


def open_store(settings: Settings) -> DeadLetterStore:
    return DeadLetterStore(settings.dsn, settings.table, bounds_of(settings))


DEAD_LETTERS = Kind(
    noun="dead letter",
    title="Dead letters",
    name="dead_letters",
    command="dead-letters",
    retried="moved back to the outbox",
    not_found="not dead letters",
    downloads=("payload", "headers"),
    as_dict=as_dict,
    render=render,
)
