"""The queue's own policies, and what each means for a message in the consumer's
hands (pure: ``consumer`` reads the queue, ``outbox.inbox.process`` and
``outbox.inbox.steps`` ask these questions).

RabbitMQ can drop a message the consumer has not settled: a quorum queue drops
(or dead-letters) a message returned more often than its ``x-delivery-limit``
(a consumer crash returns every unacked message, and counts), a message TTL
(``expiration``, ``x-message-ttl``) keeps running while a message waits in the
queue, and a stream (``x-queue-type: stream``) refuses requeues and starts a new
consumer at its end.  The consumer keeps a failed message in its hands until its
next attempt (nothing is returned, so no delivery is counted and no TTL runs),
takes a returned message into custody as it arrives (``custody``), and refuses a
stream.

Reading the queue's arguments: ``queue.declare`` (passive) returns none of them,
and the management API is a plugin that may be off.  A non-passive declare whose
arguments differ is refused with a message naming the first argument that differs
and its current value (``inequivalent arg 'x-delivery-limit' for queue 'q' in vhost
'/': received none but current is the value '2' of type 'signedint'``); each
refusal teaches one argument (``inequivalent``), and the declare whose only
difference left is a ``x-queue-type`` no queue can have names the type.  Such a
declare never creates a queue (the type is refused first).  A policy's values are
not seen this way: ``--delivery-limit`` states one.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

# What quorum queues add to a redelivered message: the returns counted so far.
DELIVERY_COUNT_HEADER = "x-delivery-count"
# What a stream adds to every message it delivers.
STREAM_OFFSET_HEADER = "x-stream-offset"
# An ``x-queue-type`` no queue has: a declare carrying it is always refused.
PROBE_TYPE = "outbox-probe"

_INEQUIVALENT = re.compile(
    r"inequivalent arg '(?P<name>[^']+)' for queue .*?: received .*? but current is "
    r"(?:none|the value '(?P<typed>.*)' of type '(?P<type>[a-z]+)'|'(?P<plain>.*)')$",
    re.DOTALL,
)
_NUMERIC = ("signedint", "long", "short", "byte", "unsignedbyte", "unsignedshort")
# Arguments whose value is a boolean: the next declare must carry a boolean (RabbitMQ
# names the current value untyped, "current is 'true'", when the declare carried one).
_BOOLEAN = ("x-single-active-consumer",)


@dataclasses.dataclass(frozen=True)
class QueuePolicy:
    """What the consumer knows of its queue: its type ('classic', 'quorum',
    'stream'; '' if unknown) and the arguments that can drop a message."""

    queue_type: str = ""
    delivery_limit: int | None = None
    message_ttl: int | None = None  # ms
    dead_letter_exchange: str | None = None
    # x-single-active-consumer: one consumer receives at a time, the next one in line
    # takes over when it cancels (``may_subscribe_again``).
    single_active_consumer: bool = False

    def describe(self) -> str:
        parts = [self.queue_type or "type unknown"]
        if self.single_active_consumer:
            parts.append("x-single-active-consumer")
        if self.delivery_limit is not None:
            parts.append(f"x-delivery-limit {self.delivery_limit}")
        if self.message_ttl is not None:
            parts.append(f"x-message-ttl {self.message_ttl} ms")
        if self.dead_letter_exchange is not None:
            parts.append(f"x-dead-letter-exchange {self.dead_letter_exchange!r}")
        return ", ".join(parts)


def inequivalent(text: str) -> tuple[str, Any] | None:
    """The argument and its current value named by a refused declare's message
    (None: not such a message); the value is None when the queue has none."""
    found = _INEQUIVALENT.search(text)
    if found is None:
        return None
    name = found["name"]
    if found["plain"] is not None:
        if name in _BOOLEAN and found["plain"] in ("true", "false"):
            return name, found["plain"] == "true"
        return name, _value(found["plain"], "")
    if found["typed"] is not None:
        return name, _value(found["typed"], found["type"])
    return name, None


def _value(text: str, amqp_type: str) -> Any:
    if amqp_type == "bool":
        return text == "true"
    if amqp_type in _NUMERIC or (not amqp_type and re.fullmatch(r"-?\d+", text)):
        return int(text)
    return text


# RabbitMQ 4.0 gives every quorum queue without one a delivery limit of 20.
DEFAULT_DELIVERY_LIMIT_SINCE_4 = 20


def policy_from(
    arguments: Mapping[str, Any], *, stated_limit: int | None, broker_version: str = ""
) -> QueuePolicy:
    """The policy of a queue declared with ``arguments``; ``stated_limit``
    (``--delivery-limit``) stands for a limit that a policy sets."""
    queue_type = str(arguments.get("x-queue-type") or "classic")
    limit = arguments.get("x-delivery-limit")
    if limit is None and queue_type == "quorum" and _major(broker_version) >= 4:
        limit = DEFAULT_DELIVERY_LIMIT_SINCE_4
    ttl = arguments.get("x-message-ttl")
    dlx = arguments.get("x-dead-letter-exchange")
    single = arguments.get("x-single-active-consumer")
    return QueuePolicy(
        queue_type=queue_type,
        delivery_limit=stated_limit if stated_limit is not None else _int(limit),
        message_ttl=_int(ttl),
        dead_letter_exchange=str(dlx) if dlx is not None else None,
        single_active_consumer=str(single).lower() == "true",
    )


def _major(version: str) -> int:
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else 0


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def refusal(policy: QueuePolicy) -> str | None:
    """Why the consumer cannot keep its promise on this queue (None: it can)."""
    if policy.queue_type == "stream":
        return (
            "it is a stream (x-queue-type: stream): a stream refuses to take a failed "
            "message back and starts a new consumer at its end, so messages would be lost"
        )
    if policy.delivery_limit == 0:
        return (
            "its x-delivery-limit is 0: a consumer that dies or loses its connection "
            "makes the broker drop every message it had in hand"
        )
    return None


def may_subscribe_again(policy: QueuePolicy) -> bool:
    """Whether the consumer may cancel its subscription and subscribe again to make
    room for the messages behind those it holds (``Inbox._make_room``).  Not on a
    queue with a single active consumer: the cancel hands the queue to the next
    consumer in line, which would apply the later messages of a key whose earlier
    message this one holds for its retry.  Nor on a queue whose arguments could not
    be read (no ``configure`` permission): it may be one."""
    return bool(policy.queue_type) and not policy.single_active_consumer


def delivery_count(headers: Mapping[Any, Any]) -> int:
    """How often the broker has taken this message back (quorum queues say so)."""
    value = headers.get(DELIVERY_COUNT_HEADER)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def from_stream(headers: Mapping[Any, Any]) -> bool:
    return STREAM_OFFSET_HEADER in headers
