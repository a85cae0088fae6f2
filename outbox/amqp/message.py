"""What a handler sees of a delivery, and the forms a parked one is kept in (pure;
``outbox.inbox.steps.parking_for`` puts them together).

A queue carries whatever its publishers sent: a ``message_id`` with a NUL byte or
bytes that are not UTF-8, headers with NULs, bytes values, nested tables and
arrays, or no properties at all.  Nothing here fails on any of them:

- ``inbox_key`` turns a message id into the text the inbox records (its key),
  losslessly (``ESCAPE``);
- ``json_safe`` and ``text_safe`` make values storable in ``jsonb`` and ``text``
  for people to read (``outbox parked list``);
- the exact bytes are kept apart: a parked message keeps its property list as it
  arrived (``raw_properties``), so ``outbox parked retry`` sends it back unchanged.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import json
from collections.abc import Mapping
from typing import Any

from outbox.message import ORDERING_KEY_HEADER

# ``outbox parked retry`` sends a message straight to the queue it was parked from
# (through the default exchange) and keeps where it first came from in these.
ORIGINAL_EXCHANGE_HEADER = "x-outbox-original-exchange"
ORIGINAL_ROUTING_KEY_HEADER = "x-outbox-original-routing-key"
# AMQP properties shown with a parked message (``outbox parked list --json``) and,
# for rows parked before raw properties were kept, sent again on retry.
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
# Set by the broker when a delivery's property list cannot be read at all: the
# message is parked with this reason, never handed to the handler.
UNREADABLE_PROPERTIES = "x-outbox-unreadable-properties"

# The inbox records message ids in a text column, which cannot hold a NUL byte
# or bytes that are not UTF-8.  Such an id is recorded as ESCAPE followed by the
# hex of its bytes (PostgreSQL's own bytea text form: decode(substr(key, 3),
# 'hex') gives the bytes back).  An id that starts with ESCAPE itself is escaped
# too, so the mapping is one to one and every id is still deduplicated; all
# other ids are recorded as they are.
ESCAPE = "\\x"


def inbox_key(message_id: str | bytes) -> str:
    """The text the inbox records for ``message_id`` (lossless, see ``ESCAPE``)."""
    if isinstance(message_id, str):
        try:
            raw = message_id.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: keep their bytes
            raw = message_id.encode("utf-8", "surrogatepass")
            return ESCAPE + raw.hex()
        text = message_id
    else:
        raw = bytes(message_id)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return ESCAPE + raw.hex()
    if "\x00" in text or text.startswith(ESCAPE):
        return ESCAPE + raw.hex()
    return text


def key_bytes(key: str) -> bytes:
    """The message id's bytes back from its inbox key (``inbox_key``'s inverse)."""
    if key.startswith(ESCAPE):
        try:
            return bytes.fromhex(key[len(ESCAPE) :])
        except ValueError:
            pass  # recorded before the escape existed: an id that looked like one
    return key.encode("utf-8")


def text_safe(text: str) -> str:
    """``text`` storable in a text column, for people to read (not lossless):
    NUL as ``\\x00``, lone surrogates as ``\\udcff``."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


@dataclasses.dataclass(frozen=True)
class InboxMessage:
    """One delivery, as the handler sees it.

    ``message_id`` is the id as the inbox records it (``inbox_key``): the id itself
    when it is UTF-8 without NUL, so a handler can store it as text.
    """

    message_id: str | None
    body: bytes
    headers: dict[Any, Any]
    exchange: str
    routing_key: str
    ordering_key: str | None
    redelivered: bool
    queue: str
    content_type: str | None = None
    properties: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # The AMQP property list exactly as it arrived (None when not known).
    raw_properties: bytes | None = None

    def json(self) -> Any:
        """The body parsed as JSON (``outbox.enqueue_json`` writes JSON)."""
        return json.loads(self.body)

    @property
    def unreadable(self) -> str | None:
        """Why the delivery's properties could not be read, if they could not."""
        reason = self.properties.get(UNREADABLE_PROPERTIES)
        return str(reason) if reason is not None else None


def _text(value: Any) -> str:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "surrogateescape")
    return str(value)


def to_inbox_message(
    body: bytes,
    properties: Mapping[str, Any],
    delivery_info: Mapping[str, Any],
    queue: str,
    raw_properties: bytes | None = None,
) -> InboxMessage:
    """Build the handler's view of a delivery (pure, never fails on content)."""
    headers = dict(properties.get("application_headers") or {})
    exchange = headers.pop(ORIGINAL_EXCHANGE_HEADER, None)
    routing_key = headers.pop(ORIGINAL_ROUTING_KEY_HEADER, None)
    message_id = properties.get("message_id")
    ordering_key = headers.get(ORDERING_KEY_HEADER)
    content_type = properties.get("content_type")
    return InboxMessage(
        message_id=inbox_key(message_id) if message_id not in (None, "", b"") else None,
        body=bytes(body),
        headers=headers,
        exchange=_text(exchange if exchange is not None else delivery_info.get("exchange", "")),
        routing_key=_text(
            routing_key if routing_key is not None else delivery_info.get("routing_key", "")
        ),
        ordering_key=_text(ordering_key) if ordering_key is not None else None,
        redelivered=bool(delivery_info.get("redelivered", False)),
        queue=queue,
        content_type=_text(content_type) if content_type is not None else None,
        properties=dict(properties),
        raw_properties=raw_properties,
    )


# Deeper tables and arrays are shown as NESTED_TOO_DEEP (a parked message keeps
# them in its raw property list): Python's recursion limit is about 1,000 frames.
MAX_JSON_DEPTH = 100
NESTED_TOO_DEEP = f"(nested deeper than {MAX_JSON_DEPTH} levels: not shown)"


def json_safe(value: Any, _depth: int = 0) -> Any:
    """AMQP header and property values as JSON that ``jsonb`` accepts, for people
    to read: bytes, timestamps and decimals as text, NUL as ``\\x00``, tables
    and arrays nested deeper than ``MAX_JSON_DEPTH`` as ``NESTED_TOO_DEEP``."""
    if isinstance(value, (Mapping, list, tuple)) and _depth >= MAX_JSON_DEPTH:
        return NESTED_TOO_DEEP
    if isinstance(value, Mapping):
        return {json_safe(_text(k)): json_safe(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, _depth + 1) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return text_safe(bytes(value).decode("utf-8", "replace"))
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, str):
        return text_safe(value)
    if isinstance(value, float) and value != value:  # NaN: not JSON
        return "NaN"
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return text_safe(str(value))
