"""``outbox parked``: the consumer's quarantine as its command and the console show it.

A parked message is one ``outbox consume`` gave up on, kept in ``<inbox>_parked``
(``outbox.db.inbox.ParkedStore``) with its body, its AMQP properties as they
arrived, where it came from, the error and the number of attempts.  Listing,
purging and the console's pages are the one quarantine's (``outbox.ops.quarantine``);
a retry sends each message back to the queue it was parked from
(``outbox.inbox.parked.retry``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outbox.ops.quarantine import Kind
from outbox.terminal import cut, shown


def as_dict(row: dict[str, Any]) -> dict[str, Any]:
    """A parked message as JSON-ready data (the body itself stays in the database).
    Its text as the list shows it (``queries.LISTED``): the error's first
    characters (``error_chars``: its length) and the headers unless they are larger
    (``headers_bytes``: their size as JSON)."""
    return {
        "message_id": row["message_id"],
        "consumer": row["consumer"],
        "queue": row["queue"],
        "exchange": row["exchange"],
        "routing_key": row["routing_key"],
        "error": row["error"],
        "error_chars": row["error_chars"],
        "attempts": row["attempts"],
        "parked_at": row["parked_at"].isoformat(),
        "body_bytes": row["body_bytes"],
        "headers": row["headers"],
        "headers_bytes": row["headers_bytes"],
    }


def render(rows: Sequence[dict[str, Any]]) -> str:
    """One line for each message and one for its error, escape sequences and line
    breaks in them shown escaped (``terminal.shown``)."""
    if not rows:
        return "no parked messages"
    lines = []
    for row in rows:
        message_id = shown(row["message_id"]) if row["message_id"] else "(no message_id)"
        lines.append(
            f"{message_id}  parked {row['parked_at']:%Y-%m-%d %H:%M:%S%z}  "
            f"attempts={row['attempts']}  queue={row['queue']!r}  "
            f"from exchange={row['exchange']!r} routing_key={row['routing_key'][:80]!r}  "
            f"{row['body_bytes']} bytes"
        )
        lines.append(f"    error: {cut(row['error'], row['error_chars'])}")
    return "\n".join(lines)


PARKED = Kind(
    noun="parked message",
    title="Parked messages",
    name="parked",
    command="parked",
    retried="sent back to their queues",
    not_found="not parked",
    downloads=("body", "headers", "properties"),
    as_dict=as_dict,
    render=render,
)
