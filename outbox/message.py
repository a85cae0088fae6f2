"""Outbox rows, the AMQP messages made from them, and the rules for bad rows.

``problem_with`` is pure: it says why a row can never be published (it becomes a
dead letter) or returns None.  Only conditions that retrying cannot fix belong
here; a broker that is down or blocked is never a reason to dead-letter a row.
It never raises, whatever the row holds: a relay must not stop because of a
row's content.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import types
import uuid
from collections.abc import Mapping
from typing import Any, NamedTuple

# The header that carries a message's ordering key (consistent-hash exchanges can
# route on it; ``outbox.amqp.message`` reads it).
ORDERING_KEY_HEADER = "x-ordering-key"
# Longest ordering key a new outbox row may have, in bytes (UTF-8): a key names an
# aggregate.  The schema's CHECK ``<table>_ordering_key_length`` says the same to
# plain SQL (schema 0004); rows written before it are relayed as ever.
ORDERING_KEY_MAX_BYTES = 1024

# AMQP 0-9-1 short strings (exchange, routing key, content type) are at most 255 bytes.
SHORTSTR_MAX = 255
# Deepest nesting of header tables and arrays we publish.  pika's encoder (and the
# checks below) recurse once or twice per level: far deeper than any real header
# and far from Python's recursion limit.
MAX_HEADER_DEPTH = 100
# Headers RabbitMQ reads as extra routing keys (sender-selected distribution); any
# other type than an array makes it close the channel (406 PRECONDITION_FAILED).
SENDER_SELECTED = ("CC", "BCC")
# AMQP timestamps are unsigned seconds since 1970.
EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


@dataclasses.dataclass(frozen=True)
class Unloadable:
    """A column value the driver could not turn into a Python value (``'infinity'``
    as a timestamp, JSON nested past Python's recursion limit): PostgreSQL's text
    of it, kept so that the dead letter stores the original."""

    text: str
    error: str


# ``OutboxRow.unloadable`` of a row whose every column loaded: shared, so read-only.
ALL_LOADED: Mapping[str, Unloadable] = types.MappingProxyType({})


class OutboxRow(NamedTuple):
    """One row of the outbox table, as claimed by the relay.

    A tuple: the relay makes one per claimed row, and a frozen dataclass cost
    six times as much to build (a tenth of the relay's CPU per message)."""

    id: int
    message_id: uuid.UUID
    exchange: str
    routing_key: str
    # As claimed: a read-only view of the driver's result (``outbox.db.rows``), so a
    # large payload is held once; bytes elsewhere.
    payload: bytes | memoryview
    headers: dict[str, Any] | None
    content_type: str | None
    created_at: datetime.datetime
    # Columns that could not be loaded (their field above holds a placeholder):
    # such a row is a dead letter naming the column.
    unloadable: Mapping[str, Unloadable] = ALL_LOADED
    # Rows sharing a key are published in id order (``outbox.relay.ordering``).
    ordering_key: str | None = None
    # The id of an earlier dead letter of the same key, when dead letters hold their
    # key back: this row follows it into the dead letters (``ordering.held``).
    held_by: int | None = None


@dataclasses.dataclass(frozen=True)
class DeadLetter:
    row: OutboxRow
    reason: str


def _nesting_depth(value: Any) -> int:
    """How deeply JSON arrays and objects nest (iterative: any depth is safe)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth > MAX_HEADER_DEPTH:
                break
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _header_problem(value: Any, path: str) -> str | None:
    """Why an AMQP field table cannot carry this JSON value, or None."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return None
    if isinstance(value, int):
        if -(2**63) <= value < 2**63:
            return None
        return f"header {path} is an integer outside the 64-bit range AMQP can carry"
    if isinstance(value, float):
        return (
            f"header {path} is a floating-point number, which AMQP field tables "
            "(as encoded by pika) cannot carry; send it as a string"
        )
    if isinstance(value, list):
        for i, item in enumerate(value):
            problem = _header_problem(item, f"{path}[{i}]")
            if problem:
                return problem
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if len(key.encode()) > SHORTSTR_MAX:
                return f"header name {path}.{key[:20]}… is longer than 255 bytes"
            problem = _header_problem(item, f"{path}.{key}")
            if problem:
                return problem
        return None
    return f"header {path} has unsupported type {type(value).__name__}"


def problem_with(row: OutboxRow, max_message_bytes: int) -> str | None:
    """The reason ``row`` can never be published, or None if it may be."""
    if row.unloadable:
        column, unloaded = next(iter(row.unloadable.items()))
        value = _clip(unloaded.text)
        detail = "" if value in unloaded.error else f" (value {value!r})"
        return f"{column} cannot be loaded: {unloaded.error}{detail}"
    # (A year after 1970 is after it in any time zone: no aware comparison per row.)
    if row.created_at.year <= 1970 and row.created_at < EPOCH:
        return (
            f"created_at {row.created_at.isoformat()} is before 1970: an AMQP timestamp "
            "counts seconds since 1970 and cannot be negative"
        )
    for field, value in (
        ("exchange", row.exchange),
        ("routing_key", row.routing_key),
        ("content_type", row.content_type or ""),
    ):
        if len(value) <= SHORTSTR_MAX // 4:
            continue  # at most 4 bytes a character in UTF-8: no need to encode it
        size = len(value.encode("utf-8"))
        if size > SHORTSTR_MAX:
            return f"{field} is {size} bytes long; AMQP allows at most {SHORTSTR_MAX}"
    if len(row.payload) > max_message_bytes:
        return (
            f"payload is {len(row.payload)} bytes; the broker accepts at most "
            f"{max_message_bytes} (max_message_size)"
        )
    if row.headers is not None:
        if not isinstance(row.headers, dict):
            return "headers must be a JSON object"
        if _nesting_depth(row.headers) > MAX_HEADER_DEPTH:
            return f"headers nest deeper than {MAX_HEADER_DEPTH} levels"
        for name in SENDER_SELECTED:
            if name in row.headers and not isinstance(row.headers[name], list):
                return (
                    f"header {name} must be an array: RabbitMQ routes a message to the "
                    f"routing keys in CC and BCC too, and closes the channel otherwise"
                )
        problem = _header_problem(row.headers, "headers")
        if problem:
            return problem
    return None


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


@dataclasses.dataclass(frozen=True)
class Refusal:
    """What a broker's channel close says about the rows of the batch it cut off.

    Either an exchange that refuses every publish (internal, or no write
    permission), or the broker's real ``max_message_size``; the rows it concerns
    are dead-lettered on the next attempt.
    """

    reason: str
    exchange: str | None = None
    max_message_bytes: int | None = None


_TOO_LARGE = re.compile(
    r"406 PRECONDITION_FAILED - message size (\d+) is larger than (?:configured )?max size (\d+)"
)
_REFUSED_EXCHANGE = re.compile(
    r"403 ACCESS_REFUSED - (?:cannot publish to internal exchange|write access to exchange) "
    r"'(.*)' in vhost"
)


def refusal_in(reason: str) -> Refusal | None:
    """The permanent refusal a channel-close reason reports, or None if it is transient.

    RabbitMQ closes the channel (406) on a message over ``max_message_size`` and
    (403) on a publish to an internal exchange or one the user may not write to.
    The close names the limit or the exchange, which identifies the bad rows.
    """
    if match := _TOO_LARGE.search(reason):
        size, limit = int(match[1]), int(match[2])
        return Refusal(
            f"a message of {size} bytes is over the broker's max_message_size ({limit})",
            max_message_bytes=limit,
        )
    if match := _REFUSED_EXCHANGE.search(reason):
        return Refusal(
            f"the broker refuses publishes to exchange {match[1]!r}: {reason}", exchange=match[1]
        )
    return None
