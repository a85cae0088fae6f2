"""``outbox parked``: look at, retry and purge messages the consumer gave up on.

A parked message keeps its body, its AMQP property list exactly as it arrived
(headers with their AMQP types, a message_id that is not UTF-8), where it came
from (exchange, routing key, queue), the error and the number of attempts; the
headers and the main properties are also kept as JSON for people to read.

``retry`` sends it again **to the queue it was parked from** (through the default
exchange, so other queues bound to the original exchange do not see it a second
time) with the same property list as it arrived, marked persistent, without its
expiration (a TTL would drop it if no consumer ran in time) and with two more
headers from which the consumer restores the original exchange and routing key.
Each parked message is sent at most once per call: the rows parked when the call
starts, in order; those parked again meanwhile wait for the next call.  It runs in
one database transaction per batch:

1. delete the parked rows, their inbox ids and attempt counters (not committed);
2. publish each message, persistent and ``mandatory``, and wait for the confirms;
3. commit.

A consumer that receives a republished message before step 3 waits on its inbox
id until the commit.  If the retry dies before committing, the rows and ids come
back, the copy already sent is skipped as a duplicate, and the message is still
listed as parked: retry it again.  Nothing is lost and nothing applied twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outbox.errors import BrokerUnavailable
from outbox.inbox.broker import QueuePublisher
from outbox.inbox.message import (
    ORIGINAL_EXCHANGE_HEADER,
    ORIGINAL_ROUTING_KEY_HEADER,
    key_bytes,
)
from outbox.inbox.store import ParkedStore

RETRY_BATCH = 500


def as_dict(row: dict[str, Any]) -> dict[str, Any]:
    """A parked message as JSON-ready data (the body itself stays in the database)."""
    return {
        "message_id": row["message_id"],
        "consumer": row["consumer"],
        "queue": row["queue"],
        "exchange": row["exchange"],
        "routing_key": row["routing_key"],
        "error": row["error"],
        "attempts": row["attempts"],
        "parked_at": row["parked_at"].isoformat(),
        "body_bytes": row["body_bytes"],
        "headers": row["headers"],
    }


def render(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return "no parked messages"
    lines = []
    for row in rows:
        message_id = row["message_id"] or "(no message_id)"
        lines.append(
            f"{message_id}  parked {row['parked_at']:%Y-%m-%d %H:%M:%S%z}  "
            f"attempts={row['attempts']}  queue={row['queue']!r}  "
            f"from exchange={row['exchange']!r} routing_key={row['routing_key'][:80]!r}  "
            f"{row['body_bytes']} bytes"
        )
        lines.append(f"    error: {row['error']}")
    return "\n".join(lines)


def retry(
    store: ParkedStore, amqp_url: str, ids: Sequence[str] | None, *, connect_timeout: float = 10.0
) -> list[str]:
    """Send parked messages (``ids`` None: all) back to their queues, each at most
    once: the rows parked when the call starts, in order (a message parked again
    while this runs waits for the next call).  Returns the ids of those sent."""
    retried: list[str] = []
    last = store.last_parked()
    after = 0
    publisher = QueuePublisher(amqp_url, connect_timeout=connect_timeout)
    try:
        while True:
            with store.taking(ids, RETRY_BATCH, after=after, last=last) as rows:
                for row in rows:
                    _send(publisher, row, len(retried))
            retried.extend(row["message_id"] for row in rows)
            if len(rows) < RETRY_BATCH:
                break
            after = rows[-1]["id"]
    finally:
        publisher.close()
    return retried


def _send(publisher: QueuePublisher, row: dict[str, Any], sent_before: int) -> None:
    headers = {
        ORIGINAL_EXCHANGE_HEADER: _text(row["exchange"]),
        ORIGINAL_ROUTING_KEY_HEADER: _text(row["routing_key"]),
    }
    raw = row["raw_properties"]
    try:
        publisher.publish(
            row["queue"],
            bytes(row["body"]),
            raw_properties=bytes(raw) if raw is not None else None,
            message_id=key_bytes(row["message_id"]),
            headers=headers if raw is not None else {**(row["headers"] or {}), **headers},
            properties=row["properties"] or {},
        )
    except Exception as exc:
        raise BrokerUnavailable(
            f"RabbitMQ did not take parked message {row['message_id']} "
            f"for queue {row['queue']!r}: {exc!r}",
            f"{sent_before} were retried before it, the rest stay parked; "
            "check that the queue exists, then retry again",
        ) from exc


def _text(key: str) -> str:
    """An exchange or routing key back from its inbox key, as AMQP text."""
    return key_bytes(key).decode("utf-8", "surrogatepass")
