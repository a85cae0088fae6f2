"""What applications call inside their own transaction.

``enqueue`` writes one row on the caller's psycopg connection; it never commits,
so the message is published if and only if the caller's transaction commits.
The statement-level trigger installed by ``outbox init`` wakes idle relays when
that transaction commits. When the application has an active OpenTelemetry span,
its W3C ``traceparent`` goes into the row's headers (``outbox.tracing``).

    with conn.transaction():
        conn.execute("INSERT INTO orders ...")
        outbox.enqueue(conn, exchange="orders", routing_key="order.created",
                       payload=b'{"id": 1}')
"""

from __future__ import annotations

import dataclasses
import functools
import json
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from outbox.message import ORDERING_KEY_MAX_BYTES
from outbox.tables import table_identifiers
from outbox.tracing import with_trace_context

_COLUMNS = (
    "message_id",
    "exchange",
    "routing_key",
    "payload",
    "headers",
    "content_type",
    "ordering_key",
)


@dataclasses.dataclass(frozen=True)
class OutgoingMessage:
    """A message for ``enqueue_many``; ``message_id`` is generated when omitted.

    Messages sharing an ``ordering_key`` reach the broker in the order they were
    written (docs/explanation/ordering.md); None puts no constraint on the message.
    """

    exchange: str
    routing_key: str
    payload: bytes
    headers: Mapping[str, Any] | None = None
    content_type: str | None = None
    message_id: uuid.UUID | None = None
    ordering_key: str | None = None


def row_params(message: OutgoingMessage) -> tuple[Any, ...]:
    """The INSERT's parameters; every way of enqueueing (psycopg, SQLAlchemy, Django) uses
    these, so a row is the same byte for byte whichever wrote it."""
    if not isinstance(message.payload, bytes | bytearray | memoryview):
        raise TypeError(
            f"payload must be bytes, not {type(message.payload).__name__}; "
            "use enqueue_json for objects"
        )
    if message.ordering_key is not None and not isinstance(message.ordering_key, str):
        raise TypeError(
            f"ordering_key must be a str or None, not {type(message.ordering_key).__name__}"
        )
    if message.ordering_key is not None:
        size = len(message.ordering_key.encode())
        if size > ORDERING_KEY_MAX_BYTES:
            raise ValueError(
                f"ordering_key is {size:,} bytes long, more than the "
                f"{ORDERING_KEY_MAX_BYTES:,} an outbox row may have: use the id of the "
                "aggregate whose messages must stay in order (docs/explanation/ordering.md)"
            )
    headers = with_trace_context(message.headers)
    return (
        message.message_id or uuid.uuid4(),
        message.exchange,
        message.routing_key,
        bytes(message.payload),
        Jsonb(dict(headers)) if headers is not None else None,
        message.content_type,
        message.ordering_key,
    )


def _insert(table: str, returning: bool) -> sql.Composed:
    query = sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
        table_identifiers(table)["outbox"],
        sql.SQL(", ").join(map(sql.Identifier, _COLUMNS)),
        sql.SQL(", ").join(sql.Placeholder() * len(_COLUMNS)),
    )
    return query + sql.SQL(" RETURNING message_id") if returning else query


def json_payload(body: Any) -> bytes:
    """The compact JSON every ``enqueue_json`` writes."""
    return json.dumps(body, separators=(",", ":")).encode()


@functools.cache
def insert_sql(table: str) -> str:
    """``_insert`` as text with ``%s`` placeholders, for a cursor that psycopg does not
    compose for: SQLAlchemy's ``exec_driver_sql`` and Django's cursor wrapper."""
    return _insert(table, returning=False).as_string(None)


def enqueue(
    conn: psycopg.Connection[Any],
    *,
    exchange: str,
    routing_key: str,
    payload: bytes,
    headers: Mapping[str, Any] | None = None,
    content_type: str | None = None,
    message_id: uuid.UUID | None = None,
    ordering_key: str | None = None,
    table: str = "outbox",
) -> uuid.UUID:
    """Write one message in the caller's transaction; returns its ``message_id``."""
    message = OutgoingMessage(
        exchange, routing_key, payload, headers, content_type, message_id, ordering_key
    )
    params = row_params(message)
    conn.execute(_insert(table, returning=False), params)
    return params[0]  # type: ignore[no-any-return]


def enqueue_many(
    conn: psycopg.Connection[Any], messages: Iterable[OutgoingMessage], *, table: str = "outbox"
) -> list[uuid.UUID]:
    """Write several messages in the caller's transaction (one round trip per batch)."""
    params = [row_params(m) for m in messages]
    if params:
        with conn.cursor() as cur:
            cur.executemany(_insert(table, returning=False), params)
    return [p[0] for p in params]


def enqueue_json(
    conn: psycopg.Connection[Any],
    *,
    exchange: str,
    routing_key: str,
    body: Any,
    headers: Mapping[str, Any] | None = None,
    message_id: uuid.UUID | None = None,
    ordering_key: str | None = None,
    table: str = "outbox",
) -> uuid.UUID:
    """``enqueue`` with ``body`` serialised as JSON (content type application/json)."""
    return enqueue(
        conn,
        exchange=exchange,
        routing_key=routing_key,
        payload=json_payload(body),
        headers=headers,
        content_type="application/json",
        message_id=message_id,
        ordering_key=ordering_key,
        table=table,
    )


async def enqueue_async(
    conn: psycopg.AsyncConnection[Any],
    *,
    exchange: str,
    routing_key: str,
    payload: bytes,
    headers: Mapping[str, Any] | None = None,
    content_type: str | None = None,
    message_id: uuid.UUID | None = None,
    ordering_key: str | None = None,
    table: str = "outbox",
) -> uuid.UUID:
    """``enqueue`` for an ``AsyncConnection``."""
    message = OutgoingMessage(
        exchange, routing_key, payload, headers, content_type, message_id, ordering_key
    )
    params = row_params(message)
    await conn.execute(_insert(table, returning=False), params)
    return params[0]  # type: ignore[no-any-return]


async def enqueue_many_async(
    conn: psycopg.AsyncConnection[Any],
    messages: Iterable[OutgoingMessage],
    *,
    table: str = "outbox",
) -> list[uuid.UUID]:
    params = [row_params(m) for m in messages]
    if params:
        async with conn.cursor() as cur:
            await cur.executemany(_insert(table, returning=False), params)
    return [p[0] for p in params]


async def enqueue_json_async(
    conn: psycopg.AsyncConnection[Any],
    *,
    exchange: str,
    routing_key: str,
    body: Any,
    headers: Mapping[str, Any] | None = None,
    message_id: uuid.UUID | None = None,
    ordering_key: str | None = None,
    table: str = "outbox",
) -> uuid.UUID:
    return await enqueue_async(
        conn,
        exchange=exchange,
        routing_key=routing_key,
        payload=json_payload(body),
        headers=headers,
        content_type="application/json",
        message_id=message_id,
        ordering_key=ordering_key,
        table=table,
    )
