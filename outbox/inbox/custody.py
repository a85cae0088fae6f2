"""Custody: messages the consumer stores before the broker can drop them (pure).

A quorum queue with a delivery limit (``x-delivery-limit``; 20 by default since
RabbitMQ 4.0) drops, or dead-letters, a message returned more often than the
limit, and a consumer that dies or loses its connection returns every message it
holds, each counting.  A crash loop (an OOM killer, a node eviction, a handler that
kills the process) therefore spends the deliveries of every message in hand, the
healthy ones too, until the broker drops them.  No handler call is short enough to
be safe: what the consumer holds while a handler runs is what the next crash spends.

So on such a queue the consumer takes custody of a message as soon as it knows the
broker has returned it once (``needs_custody``: ``x-delivery-count`` or the
``redelivered`` flag): every such message in a drain of the socket goes into
``<inbox>_custody``, as it arrived (the property list exactly, the body, where it
came from: ``stored``), in one transaction, and is acked once that commits.  From
then on the broker holds nothing of it; a crash costs the message nothing, and the
consumer applies it from the table (``restored``: the same ``InboxMessage`` the
handler would have seen), alone, with its attempt counted before the call, as any
redelivered message (``steps.Processor.alone``).  The transaction of its effect
deletes its row.  A failed attempt waits in the table for its retry delay; one that
reaches ``--max-attempts`` is parked as usual.  A message in custody only because
of a crash loop is applied, never parked for it.

Custody starts at the first return, not at the last delivery: with limit N a
message must come back N times to be at risk, and each time it comes back it is
stored before anything else runs, so a crash between its arrival and that commit
(one round trip) is the only way to spend a second delivery.  Messages in hand
that were never returned (first deliveries) are one return away from custody.

Per ordering key: while custody holds messages, every keyed message that arrives
goes into custody too (behind the key's earlier ones), and custody gives the
messages of a key in the order they were stored, one at a time, a failed one
holding its key (``next_in_custody``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from outbox.amqp import properties as wire
from outbox.amqp.message import InboxMessage, inbox_key, key_bytes, to_inbox_message
from outbox.amqp.policy import QueuePolicy, delivery_count
from outbox.db.inbox import Stored


def needs_custody(message: InboxMessage, policy: QueuePolicy) -> bool:
    """Whether ``message`` goes into custody as it arrives (pure): on a queue that
    may drop a returned message (``may_drop_returned``), a message the broker
    returned before.  A message without a usable id is parked at once instead
    (nothing to store it by)."""
    if not may_drop_returned(policy) or not storable(message):
        return False
    return message.redelivered or delivery_count(message.headers) > 0


def to_take(
    messages: Sequence[InboxMessage],
    policy: QueuePolicy,
    *,
    held: bool,
    waiting_keys: Collection[str] = (),
) -> list[bool]:
    """Which of ``messages`` (one drain, in order) go into custody (pure): those
    that need it, and, while custody holds messages (``held``, or some of these
    go in), every message with an ordering key, so that none overtakes an earlier
    message of its key that waits in custody; except a first delivery of a key in
    ``waiting_keys``, whose earlier message waits in the consumer's hands for its
    retry: it waits behind that one, in hand."""
    taken = [needs_custody(m, policy) for m in messages]
    if held or any(taken):
        taken = [
            t
            or (
                m.ordering_key is not None
                and m.ordering_key not in waiting_keys
                and storable(m)
                and may_drop_returned(policy)
            )
            for t, m in zip(taken, messages, strict=True)
        ]
    return taken


def storable(message: InboxMessage) -> bool:
    return message.message_id is not None and message.unreadable is None


def may_drop_returned(policy: QueuePolicy) -> bool:
    """Whether the queue may drop a message returned too often (pure): a delivery
    limit is known, or the queue's type could not be read (no ``configure``
    permission: a quorum queue with a limit set by a policy looks the same)."""
    return policy.delivery_limit is not None or not policy.queue_type


def stored(message: InboxMessage) -> Stored:
    assert message.message_id is not None  # needs_custody
    raw = message.raw_properties
    if raw is None:  # not from the broker's frame reader (a test's double)
        raw = wire.encode(
            {
                **message.properties,
                "message_id": key_bytes(message.message_id),
                "application_headers": message.headers,
            }
        )
    return Stored(
        message_id=message.message_id,
        ordering_key=inbox_key(message.ordering_key) if message.ordering_key is not None else None,
        exchange=inbox_key(message.exchange),
        routing_key=inbox_key(message.routing_key),
        body=message.body,
        raw_properties=raw,
    )


def restored(
    *, queue: str, exchange: str, routing_key: str, body: bytes, raw_properties: bytes
) -> InboxMessage:
    """The message a row of ``<inbox>_custody`` holds, as the handler would have seen
    it from the broker; ``redelivered``: it was returned at least once, and it is
    applied alone with its attempt counted first (``Processor.alone``)."""
    props, _ = wire.decode(raw_properties)
    delivery_info = {
        "exchange": key_bytes(exchange),
        "routing_key": key_bytes(routing_key),
        "redelivered": True,
    }
    return to_inbox_message(bytes(body), props, delivery_info, queue, raw_properties=raw_properties)
