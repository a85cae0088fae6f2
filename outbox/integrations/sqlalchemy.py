"""Enqueue on a SQLAlchemy 2 ``Session`` / ``Connection`` (or their asyncio versions).

The row is written in the session's current transaction (SQLAlchemy begins one if
none is open) and is published if and only if the application commits it; these
functions never commit. The statement and its parameters are those of
``outbox.enqueue``, executed with ``exec_driver_sql``, so a row is the same byte for
byte whichever way it was written, and SQLAlchemy's events, logging and
instrumentation see the statement like any other.

Requires SQLAlchemy ≥ 2.0 (``pip install 'outbox-relay[sqlalchemy]'``) and the
psycopg 3 driver (``postgresql+psycopg://…``), since the parameters are psycopg
values (``Jsonb``)::

    from outbox.integrations import sqlalchemy as outbox_sa

    with Session(engine) as session, session.begin():
        session.add(Order(id=1))
        outbox_sa.enqueue(session, exchange="orders", routing_key="order.created",
                          payload=b'{"id": 1}')

A session bound to several engines writes on the one ``Session.connection()``
returns; pass ``session.connection(bind_arguments=…)`` to choose another.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

try:
    from sqlalchemy.engine import Connection, Dialect
    from sqlalchemy.orm import Session
except ImportError as exc:
    raise ImportError(
        "outbox.integrations.sqlalchemy needs SQLAlchemy 2: pip install 'outbox-relay[sqlalchemy]'"
    ) from exc

from outbox.enqueue import (
    OutgoingMessage,
    Row,
    cancel_sql,
    insert_sql,
    json_message,
    spelled_out,
    write,
    write_async,
)
from outbox.errors import OutboxError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
    from typing_extensions import Unpack

    from outbox.enqueue import JsonFields, MessageFields

__all__ = [
    "cancel",
    "cancel_async",
    "enqueue",
    "enqueue_async",
    "enqueue_json",
    "enqueue_json_async",
    "enqueue_many",
    "enqueue_many_async",
]


def _check(dialect: Dialect, driver_connection: Any) -> None:
    """Refuse what would silently break the outbox's promise, before writing anything."""
    if dialect.name != "postgresql" or dialect.driver != "psycopg":
        raise OutboxError(
            f"the outbox needs PostgreSQL through psycopg 3; this engine uses "
            f"{dialect.name}+{dialect.driver}",
            hint="create the engine with a postgresql+psycopg:// URL",
        )
    if driver_connection.autocommit:
        raise OutboxError(
            "this connection is in AUTOCOMMIT mode: the message would be committed "
            "on its own, apart from the application's data",
            hint="enqueue on a connection or session without isolation_level='AUTOCOMMIT'",
        )


def _connection(target: Session | Connection) -> Connection:
    conn = target.connection() if isinstance(target, Session) else target
    _check(conn.dialect, conn.connection.driver_connection)
    return conn


async def _async_connection(target: AsyncSession | AsyncConnection) -> AsyncConnection:
    from sqlalchemy.ext.asyncio import AsyncSession

    conn = await target.connection() if isinstance(target, AsyncSession) else target
    _check(conn.dialect, (await conn.get_raw_connection()).driver_connection)
    return conn


def _insert_on(target: Session | Connection, table: str) -> Callable[[list[Row], bool], None]:
    def insert(rows: list[Row], scheduled: bool) -> None:
        statement = insert_sql(table, scheduled)
        _connection(target).exec_driver_sql(statement, rows[0] if len(rows) == 1 else rows)

    return insert


def _insert_on_async(
    target: AsyncSession | AsyncConnection, table: str
) -> Callable[[list[Row], bool], Awaitable[None]]:
    async def insert(rows: list[Row], scheduled: bool) -> None:
        conn = await _async_connection(target)
        statement = insert_sql(table, scheduled)
        await conn.exec_driver_sql(statement, rows[0] if len(rows) == 1 else rows)

    return insert


@spelled_out
def enqueue(
    target: Session | Connection, *, table: str = "outbox", **message: Unpack[MessageFields]
) -> uuid.UUID:
    """Write one message in ``target``'s transaction; returns its ``message_id``."""
    return write(_insert_on(target, table), [OutgoingMessage(**message)])[0]


def enqueue_many(
    target: Session | Connection, messages: Iterable[OutgoingMessage], *, table: str = "outbox"
) -> list[uuid.UUID]:
    """Write several messages in ``target``'s transaction (one executemany)."""
    return write(_insert_on(target, table), messages)


@spelled_out
def enqueue_json(
    target: Session | Connection, *, table: str = "outbox", **message: Unpack[JsonFields]
) -> uuid.UUID:
    """``enqueue`` with ``body`` serialised as JSON (content type application/json)."""
    return write(_insert_on(target, table), [json_message(**message)])[0]


@spelled_out
async def enqueue_async(
    target: AsyncSession | AsyncConnection,
    *,
    table: str = "outbox",
    **message: Unpack[MessageFields],
) -> uuid.UUID:
    """``enqueue`` for an ``AsyncSession`` or ``AsyncConnection``."""
    return (await write_async(_insert_on_async(target, table), [OutgoingMessage(**message)]))[0]


async def enqueue_many_async(
    target: AsyncSession | AsyncConnection,
    messages: Iterable[OutgoingMessage],
    *,
    table: str = "outbox",
) -> list[uuid.UUID]:
    """``enqueue_many`` for an ``AsyncSession`` or ``AsyncConnection``."""
    return await write_async(_insert_on_async(target, table), messages)


@spelled_out
async def enqueue_json_async(
    target: AsyncSession | AsyncConnection,
    *,
    table: str = "outbox",
    **message: Unpack[JsonFields],
) -> uuid.UUID:
    """``enqueue_json`` for an ``AsyncSession`` or ``AsyncConnection``."""
    return (await write_async(_insert_on_async(target, table), [json_message(**message)]))[0]


def cancel(target: Session | Connection, message_id: uuid.UUID, *, table: str = "outbox") -> bool:
    """``outbox.cancel`` in the session's (or connection's) transaction."""
    result = _connection(target).exec_driver_sql(cancel_sql(table), (message_id,))
    return bool(result.rowcount > 0)


async def cancel_async(
    target: AsyncSession | AsyncConnection, message_id: uuid.UUID, *, table: str = "outbox"
) -> bool:
    """``cancel`` for an ``AsyncSession`` or ``AsyncConnection``."""
    conn = await _async_connection(target)
    result = await conn.exec_driver_sql(cancel_sql(table), (message_id,))
    return bool(result.rowcount > 0)
