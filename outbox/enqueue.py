"""What applications call inside their own transaction.

``enqueue`` writes one row on the caller's psycopg connection; it never commits,
so the message is published if and only if the caller's transaction commits.
The statement-level trigger installed by ``outbox init`` wakes idle relays when
that transaction commits. When the application has an active OpenTelemetry span,
its W3C ``traceparent`` goes into the row's headers (``outbox.tracing``).
``deliver_at``/``delay`` schedule the message for later (schema 0009: the outbox's
trigger keeps it in ``<outbox>_scheduled`` until due), and ``cancel`` takes a
scheduled message back in the caller's transaction.

    with conn.transaction():
        conn.execute("INSERT INTO orders ...")
        outbox.enqueue(conn, exchange="orders", routing_key="order.created",
                       payload=b'{"id": 1}')
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import inspect
import json
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from outbox.message import ORDERING_KEY_MAX_BYTES
from outbox.tables import table_identifiers
from outbox.tracing import with_trace_context

if TYPE_CHECKING:
    # Only for type checkers (typing_extensions: NotRequired and Unpack on Python 3.10).
    from typing_extensions import NotRequired, TypedDict, Unpack

    class _Addressed(TypedDict):
        exchange: str
        routing_key: str
        headers: NotRequired[Mapping[str, Any] | None]
        message_id: NotRequired[uuid.UUID | None]
        ordering_key: NotRequired[str | None]
        deliver_at: NotRequired[datetime.datetime | None]
        delay: NotRequired[datetime.timedelta | None]

    class MessageFields(_Addressed):
        """The keywords of every ``enqueue``: ``OutgoingMessage``'s fields."""

        payload: bytes
        content_type: NotRequired[str | None]

    class JsonFields(_Addressed):
        """The keywords of every ``enqueue_json``: ``body`` in place of the payload."""

        body: Any


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

    ``deliver_at`` (an aware datetime) or ``delay`` (from the transaction's start,
    by the database's clock) hold the message until then (docs/how-to/deliver-later.md);
    a key's scheduled rows go out in due order, when due.
    """

    exchange: str
    routing_key: str
    payload: bytes
    headers: Mapping[str, Any] | None = None
    content_type: str | None = None
    message_id: uuid.UUID | None = None
    ordering_key: str | None = None
    deliver_at: datetime.datetime | None = None
    delay: datetime.timedelta | None = None

    @property
    def scheduled(self) -> bool:
        """Written with a time: its INSERT names ``deliver_at`` (schema 0009)."""
        return self.deliver_at is not None or self.delay is not None


def _schedule_params(message: OutgoingMessage) -> tuple[Any, ...]:
    """``deliver_at`` and ``delay`` checked: the two parameters of the scheduled INSERT."""
    if message.deliver_at is not None and message.delay is not None:
        raise ValueError("give deliver_at or delay, not both")
    if message.deliver_at is not None:
        if not isinstance(message.deliver_at, datetime.datetime):
            raise TypeError(
                f"deliver_at must be a datetime, not {type(message.deliver_at).__name__}"
            )
        if message.deliver_at.utcoffset() is None:
            raise ValueError(
                "deliver_at must be timezone-aware (a naive datetime names no instant): "
                "use datetime.now(timezone.utc) + …, or delay="
            )
    if message.delay is not None and not isinstance(message.delay, datetime.timedelta):
        raise TypeError(f"delay must be a timedelta, not {type(message.delay).__name__}")
    return (message.deliver_at, message.delay or datetime.timedelta(0))


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
    schedule = _schedule_params(message) if message.scheduled else ()
    headers = with_trace_context(message.headers)
    return (
        message.message_id or uuid.uuid4(),
        message.exchange,
        message.routing_key,
        bytes(message.payload),
        Jsonb(dict(headers)) if headers is not None else None,
        message.content_type,
        message.ordering_key,
        *schedule,
    )


def _insert(table: str, scheduled: bool = False) -> sql.Composed:
    """The INSERT of a row; a scheduled one names ``deliver_at`` (the given time, else
    the transaction's now() plus the delay), which the outbox's trigger sends to the
    scheduled table when in the future (schema 0009).  A row without a time uses the
    statement of schema 0008 and earlier."""
    columns = sql.SQL(", ").join(map(sql.Identifier, _COLUMNS))
    values = sql.SQL(", ").join(sql.Placeholder() * len(_COLUMNS))
    if scheduled:
        columns = sql.SQL("{}, deliver_at").format(columns)
        values = sql.SQL("{}, coalesce({}::timestamptz, now()) + {}::interval").format(
            values, sql.Placeholder(), sql.Placeholder()
        )
    return sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
        table_identifiers(table)["outbox"], columns, values
    )


def json_payload(body: Any) -> bytes:
    """The compact JSON every ``enqueue_json`` writes."""
    return json.dumps(body, separators=(",", ":")).encode()


@functools.cache
def insert_sql(table: str, scheduled: bool = False) -> str:
    """``_insert`` as text with ``%s`` placeholders, for a cursor that psycopg does not
    compose for: SQLAlchemy's ``exec_driver_sql`` and Django's cursor wrapper."""
    return _insert(table, scheduled).as_string(None)


Row = tuple[Any, ...]

# Inserts a list of rows, all scheduled or none (``write``).
Insert = Callable[[list[Row], bool], object]
AsyncInsert = Callable[[list[Row], bool], Awaitable[object]]


def _by_kind(rows: list[Row]) -> list[tuple[list[Row], bool]]:
    """The rows without a time, then the scheduled ones (one INSERT each, if any)."""
    now = [r for r in rows if len(r) == len(_COLUMNS)]
    later = [r for r in rows if len(r) > len(_COLUMNS)]
    return [(part, scheduled) for part, scheduled in ((now, False), (later, True)) if part]


def json_message(body: Any, **fields: Unpack[_Addressed]) -> OutgoingMessage:
    """The message every ``enqueue_json`` writes: ``body`` as compact JSON."""
    return OutgoingMessage(payload=json_payload(body), content_type="application/json", **fields)


def write(insert: Insert, messages: Iterable[OutgoingMessage]) -> list[uuid.UUID]:
    """How every ``enqueue*`` (psycopg, SQLAlchemy, Django) writes: every row is built
    and checked first, so a refused message writes nothing, then ``insert`` runs the
    INSERT on the caller's connection (a list of one row: one execute), once for the
    rows without a time and once for the scheduled ones, unless there are none.
    Returns the ``message_id`` of each row."""
    rows = [row_params(m) for m in messages]
    for part, scheduled in _by_kind(rows):
        insert(part, scheduled)
    return [row[0] for row in rows]


async def write_async(insert: AsyncInsert, messages: Iterable[OutgoingMessage]) -> list[uuid.UUID]:
    """``write`` for an asyncio connection."""
    rows = [row_params(m) for m in messages]
    for part, scheduled in _by_kind(rows):
        await insert(part, scheduled)
    return [row[0] for row in rows]


_F = TypeVar("_F", bound=Callable[..., Any])

_FIELDS = [
    inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.type)
    if f.default is dataclasses.MISSING
    else inspect.Parameter(
        f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type
    )
    for f in dataclasses.fields(OutgoingMessage)
]


def _fields_for(json: bool) -> list[inspect.Parameter]:
    if not json:
        return _FIELDS
    body = inspect.Parameter("body", inspect.Parameter.KEYWORD_ONLY, annotation="Any")
    return [body if p.name == "payload" else p for p in _FIELDS if p.name != "content_type"]


def spelled_out(function: _F) -> _F:
    """Show ``OutgoingMessage``'s fields in ``function``'s signature in place of its
    ``**message`` (``body`` in place of the payload for a ``**message`` typed
    ``JsonFields``), where they stood when each was written out, so ``help()`` and the
    API reference list them; the fields themselves are declared once, here."""
    signature = inspect.signature(function)
    own = list(signature.parameters.values())
    [message] = [p for p in own if p.kind is inspect.Parameter.VAR_KEYWORD]
    fields = _fields_for(json="JsonFields" in str(message.annotation))
    before = [p for p in own if p.kind is not inspect.Parameter.KEYWORD_ONLY and p != message]
    after = [p for p in own if p.kind is inspect.Parameter.KEYWORD_ONLY]
    function.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[*before, *fields, *after]
    )
    return function


def _insert_on(conn: psycopg.Connection[Any], table: str) -> Callable[[list[Row], bool], None]:
    def insert(rows: list[Row], scheduled: bool) -> None:
        if len(rows) == 1:
            conn.execute(_insert(table, scheduled), rows[0])
        else:
            with conn.cursor() as cur:
                cur.executemany(_insert(table, scheduled), rows)

    return insert


def _insert_on_async(
    conn: psycopg.AsyncConnection[Any], table: str
) -> Callable[[list[Row], bool], Awaitable[None]]:
    async def insert(rows: list[Row], scheduled: bool) -> None:
        if len(rows) == 1:
            await conn.execute(_insert(table, scheduled), rows[0])
        else:
            async with conn.cursor() as cur:
                await cur.executemany(_insert(table, scheduled), rows)

    return insert


def cancel_sql(table: str) -> str:
    """``cancel``'s statement as text with a ``%s`` placeholder (for the integrations)."""
    return (
        sql.SQL("DELETE FROM {} WHERE message_id = %s")
        .format(table_identifiers(table)["scheduled"])
        .as_string(None)
    )


def cancel(conn: psycopg.Connection[Any], message_id: uuid.UUID, *, table: str = "outbox") -> bool:
    """Cancel a scheduled message in the caller's transaction: True if it was still
    waiting for its time (it will never be published if this transaction commits),
    False if unknown, or already due and taken by a relay for delivery (published,
    or about to be: a relay moves a due row within milliseconds of its time).

    Never waits on a relay's prepared batch (scheduled rows are never in one); it
    may wait a moment for a relay's mover that is moving this very row."""
    cur = conn.execute(cancel_sql(table).encode(), (message_id,))
    return cur.rowcount > 0


async def cancel_async(
    conn: psycopg.AsyncConnection[Any], message_id: uuid.UUID, *, table: str = "outbox"
) -> bool:
    """``cancel`` for an ``AsyncConnection``."""
    cur = await conn.execute(cancel_sql(table).encode(), (message_id,))
    return cur.rowcount > 0


@spelled_out
def enqueue(
    conn: psycopg.Connection[Any], *, table: str = "outbox", **message: Unpack[MessageFields]
) -> uuid.UUID:
    """Write one message in the caller's transaction; returns its ``message_id``."""
    return write(_insert_on(conn, table), [OutgoingMessage(**message)])[0]


def enqueue_many(
    conn: psycopg.Connection[Any], messages: Iterable[OutgoingMessage], *, table: str = "outbox"
) -> list[uuid.UUID]:
    """Write several messages in the caller's transaction (one round trip per batch)."""
    return write(_insert_on(conn, table), messages)


@spelled_out
def enqueue_json(
    conn: psycopg.Connection[Any], *, table: str = "outbox", **message: Unpack[JsonFields]
) -> uuid.UUID:
    """``enqueue`` with ``body`` serialised as JSON (content type application/json)."""
    return write(_insert_on(conn, table), [json_message(**message)])[0]


@spelled_out
async def enqueue_async(
    conn: psycopg.AsyncConnection[Any], *, table: str = "outbox", **message: Unpack[MessageFields]
) -> uuid.UUID:
    """``enqueue`` for an ``AsyncConnection``."""
    return (await write_async(_insert_on_async(conn, table), [OutgoingMessage(**message)]))[0]


async def enqueue_many_async(
    conn: psycopg.AsyncConnection[Any],
    messages: Iterable[OutgoingMessage],
    *,
    table: str = "outbox",
) -> list[uuid.UUID]:
    """``enqueue_many`` for an ``AsyncConnection``."""
    return await write_async(_insert_on_async(conn, table), messages)


@spelled_out
async def enqueue_json_async(
    conn: psycopg.AsyncConnection[Any], *, table: str = "outbox", **message: Unpack[JsonFields]
) -> uuid.UUID:
    """``enqueue_json`` for an ``AsyncConnection``."""
    return (await write_async(_insert_on_async(conn, table), [json_message(**message)]))[0]
