"""What a handler sees of a delivery, and what is kept of a parked one (pure)."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import json
from collections.abc import Mapping
from typing import Any

from outbox.inbox.store import Parking
from outbox.relay.ordering import ORDERING_KEY_HEADER

# ``outbox parked retry`` sends a message straight to the queue it was parked from
# (through the default exchange) and keeps where it first came from in these.
ORIGINAL_EXCHANGE_HEADER = "x-outbox-original-exchange"
ORIGINAL_ROUTING_KEY_HEADER = "x-outbox-original-routing-key"
# AMQP properties kept with a parked message and sent again on retry.
KEPT_PROPERTIES = (
    "content_type",
    "content_encoding",
    "correlation_id",
    "reply_to",
    "type",
    "app_id",
    "priority",
    "timestamp",
)


@dataclasses.dataclass(frozen=True)
class InboxMessage:
    """One delivery, as the handler sees it."""

    message_id: str | None
    body: bytes
    headers: dict[str, Any]
    exchange: str
    routing_key: str
    ordering_key: str | None
    redelivered: bool
    queue: str
    content_type: str | None = None
    properties: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def json(self) -> Any:
        """The body parsed as JSON (``outbox.enqueue_json`` writes JSON)."""
        return json.loads(self.body)


def to_inbox_message(
    body: bytes,
    properties: Mapping[str, Any],
    delivery_info: Mapping[str, Any],
    queue: str,
) -> InboxMessage:
    """Build the handler's view of a delivery (pure)."""
    headers = dict(properties.get("application_headers") or {})
    exchange = headers.pop(ORIGINAL_EXCHANGE_HEADER, None)
    routing_key = headers.pop(ORIGINAL_ROUTING_KEY_HEADER, None)
    message_id = properties.get("message_id")
    ordering_key = headers.get(ORDERING_KEY_HEADER)
    return InboxMessage(
        message_id=str(message_id) if message_id not in (None, "") else None,
        body=bytes(body),
        headers=headers,
        exchange=str(exchange if exchange is not None else delivery_info.get("exchange", "")),
        routing_key=str(
            routing_key if routing_key is not None else delivery_info.get("routing_key", "")
        ),
        ordering_key=str(ordering_key) if ordering_key is not None else None,
        redelivered=bool(delivery_info.get("redelivered", False)),
        queue=queue,
        content_type=properties.get("content_type"),
        properties=dict(properties),
    )


def json_safe(value: Any) -> Any:
    """AMQP header and property values as JSON (bytes, timestamps, decimals as text)."""
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def parking_for(message: InboxMessage, error: str) -> Parking:
    properties = {k: message.properties[k] for k in KEPT_PROPERTIES if k in message.properties}
    return Parking(
        message_id=message.message_id,
        queue=message.queue,
        exchange=message.exchange,
        routing_key=message.routing_key,
        body=message.body,
        headers=json_safe(message.headers),
        properties=json_safe(properties),
        error=error,
    )
