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
starts, in order; those parked again meanwhile wait for the next call.

Pages of rows are taken in order, as many as fit ``max_bytes`` of what they load
(body, headers, properties, raw property list, keys; a larger one alone), so memory
stays bounded whatever is parked; each page in three steps,
none of which holds a transaction open across a wait for the broker:

1. one short transaction: read the rows with their bodies, and remove their inbox
   ids and attempt counters (so the copies sent next are applied, not skipped);
2. publish each message, persistent and ``mandatory``, and wait for its confirm
   (at most ``confirm_timeout`` seconds: ``ConfirmTimedOut``); one the broker does
   not take (its queue is gone, a nack) stays parked, reported, and the next is sent;
3. one short transaction: delete the parked rows whose copies were confirmed
   (not those parked again meanwhile: their copy failed again).

A consumer that receives a copy applies it at once: nothing of the retry's holds
its inbox row.  If the retry dies or times out between steps 1 and 3, the messages
of that page stay listed as parked, and their copies may be on the queue: retry
again, and the inbox skips a copy whose message was applied.  A duplicate the inbox
drops, never a loss.  (One transaction across the three steps held the message's
inbox row while waiting for the broker, and the consumer that received the copy
waited on it, and every message behind it.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, NamedTuple

from outbox.amqp.consumer import QueuePublisher
from outbox.amqp.message import (
    ORIGINAL_EXCHANGE_HEADER,
    ORIGINAL_ROUTING_KEY_HEADER,
    key_bytes,
)
from outbox.db.inbox import ParkedStore
from outbox.errors import BrokerUnavailable, ConfirmTimedOut, NotTaken, OutboxError

# The most rows one page of a retry looks at (their sizes only), and the most body
# bytes a page holds in memory unless one body alone is larger.
RETRY_PAGE_ROWS = 500
RETRY_MAX_BYTES = 16 * 1024 * 1024


def retry(
    store: ParkedStore,
    amqp_url: str,
    ids: Sequence[str] | None,
    *,
    connect_timeout: float = 10.0,
    confirm_timeout: float = 30.0,
    max_bytes: int = RETRY_MAX_BYTES,
    not_sent: list[NotSent] | None = None,
) -> list[str]:
    """Send parked messages (``ids`` None: all) back to their queues, each at most
    once: the rows parked when the call starts, in order (a message parked again
    while this runs waits for the next call).  Returns the ids of those sent.

    A message the broker does not take and says why (its queue is gone: returned
    unroutable; nacked), or that cannot be sent at all, stays parked and is added
    to ``not_sent`` (message id and why); the others are sent.  A broker that
    cannot be reached or does not answer in time ends the call."""
    retried: list[str] = []
    last = store.last_parked()
    after = 0
    publisher = QueuePublisher(
        amqp_url, connect_timeout=connect_timeout, confirm_timeout=confirm_timeout
    )
    try:
        while True:
            sizes = store.retry_sizes(ids, after=after, last=last, limit=RETRY_PAGE_ROWS)
            if not sizes:
                break
            page = fitting(sizes, max_bytes)
            after = page[-1]
            rows = store.release(page)
            rows.reverse()
            sent: list[dict[str, Any]] = []
            try:
                while rows:
                    row = rows.pop()  # its body is freed once it is sent
                    try:
                        _send(publisher, row, len(retried) + len(sent))
                    except NotTaken as exc:
                        # It stays parked (not in ``sent``); the next one is sent.
                        if not_sent is not None:
                            not_sent.append(NotSent(row["message_id"], str(exc)))
                        continue
                    del row["body"]
                    sent.append(row)
            except BaseException:
                # What the broker confirmed is not listed (and sent) again.
                with contextlib.suppress(OutboxError):
                    store.retried(sent)
                raise
            store.retried(sent)
            retried.extend(row["message_id"] for row in sent)
    finally:
        publisher.close()
    return retried


class NotSent(NamedTuple):
    """A parked message ``retry`` left parked, and why."""

    message_id: str
    why: str


def fitting(sizes: Sequence[tuple[int, int]], max_bytes: int) -> list[int]:
    """The row numbers of the first ``sizes`` (row number, bytes it loads) that fit
    in ``max_bytes`` together; the first one alone if it is larger (pure)."""
    taken: list[int] = []
    total = 0
    for parked_id, size in sizes:
        if taken and total + size > max_bytes:
            break
        taken.append(parked_id)
        total += size
    return taken


def _send(publisher: QueuePublisher, row: dict[str, Any], sent_before: int) -> None:
    headers = {
        ORIGINAL_EXCHANGE_HEADER: original_key(row["exchange"]),
        ORIGINAL_ROUTING_KEY_HEADER: original_key(row["routing_key"]),
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
    except NotTaken:
        raise  # this one stays parked, the next one is sent
    except ConfirmTimedOut as exc:
        raise ConfirmTimedOut(
            f"{exc.message} (parked message {row['message_id']}; {sent_before} were "
            "retried before it)",
            exc.hint,
        ) from exc
    except Exception as exc:
        raise BrokerUnavailable(
            f"RabbitMQ did not take parked message {row['message_id']} "
            f"for queue {row['queue']!r}: {exc!r}",
            f"{sent_before} were retried before it, the rest stay parked; "
            "check that the queue exists, then retry again",
        ) from exc


def original_key(key: str) -> bytes:
    """An exchange or routing key as it arrived (its bytes, sent as a header value),
    back from its inbox key (pure).  The consumer read one that was not UTF-8 with
    each such byte as a lone surrogate (``surrogateescape``), and the inbox key
    holds those as UTF-8 with surrogates, escaped (``inbox_key``); a key recorded
    as the escape of the bytes themselves is those bytes."""
    raw = key_bytes(key)
    try:
        return raw.decode("utf-8", "surrogatepass").encode("utf-8", "surrogateescape")
    except UnicodeError:
        return raw
