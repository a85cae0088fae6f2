"""Enqueue from Django (psycopg 3 backend), and the outbox schema as a Django app.

Add ``"outbox.integrations.django"`` to ``INSTALLED_APPS``: ``manage.py migrate``
then creates the outbox schema (the migration runs what ``outbox init`` runs), and
``manage.py outbox_init`` does the same on demand (``--print-sql`` prints it).
``settings.OUTBOX_TABLE`` names the table (default ``outbox``).

Enqueue inside ``transaction.atomic()``: the row is published if and only if that
transaction commits. Outside one, Django commits every statement on its own, so
these functions refuse to write rather than commit the message apart from the
data it describes::

    from django.db import transaction
    from outbox.integrations import django as outbox_django

    with transaction.atomic():
        order = Order.objects.create(...)
        outbox_django.enqueue_json(exchange="orders", routing_key="order.created",
                                   body={"id": order.id})

The statement and parameters are those of ``outbox.enqueue``, run through Django's
cursor (so query logging and instrumentation see it), which makes the row the same
byte for byte as one written by psycopg or plain SQL.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

try:
    from django.conf import settings
    from django.db import DEFAULT_DB_ALIAS, connections
    from django.db.backends.base.base import BaseDatabaseWrapper
except ImportError as exc:
    raise ImportError(
        "outbox.integrations.django needs Django: pip install 'outbox-relay[django]'"
    ) from exc

import psycopg

from outbox.db import migrate
from outbox.enqueue import (
    OutgoingMessage,
    Row,
    cancel_sql,
    insert_sql,
    json_message,
    spelled_out,
    write,
)
from outbox.errors import OutboxError

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from outbox.enqueue import JsonFields, MessageFields

__all__ = ["cancel", "enqueue", "enqueue_json", "enqueue_many", "migrate_schema", "outbox_table"]

DEFAULT_TABLE = "outbox"


def outbox_table() -> str:
    """``settings.OUTBOX_TABLE``, or ``outbox``."""
    return str(getattr(settings, "OUTBOX_TABLE", DEFAULT_TABLE))


def _psycopg_connection(connection: BaseDatabaseWrapper) -> psycopg.Connection[Any]:
    """The psycopg 3 connection under a Django database, or a clear error."""
    if connection.vendor != "postgresql":
        raise OutboxError(
            f"database {connection.alias!r} is {connection.vendor}; the outbox needs PostgreSQL",
            hint="use a database whose ENGINE is django.db.backends.postgresql",
        )
    connection.ensure_connection()
    raw = connection.connection
    if not isinstance(raw, psycopg.Connection):
        raise OutboxError(
            f"database {connection.alias!r} runs on {type(raw).__module__}; "
            "the outbox needs psycopg 3",
            hint="pip install 'psycopg[binary]' (Django prefers psycopg 3 when both are there)",
        )
    return raw


def _in_transaction(using: str) -> BaseDatabaseWrapper:
    connection = connections[using]
    _psycopg_connection(connection)
    if connection.get_autocommit():
        raise OutboxError(
            "outbox enqueue ran outside a transaction: Django would commit the message "
            "on its own, apart from the application's data",
            hint="write the data and enqueue inside `with transaction.atomic():`",
        )
    return connection


def _insert_on(using: str, table: str | None) -> Callable[[list[Row], bool], None]:
    def insert(rows: list[Row], scheduled: bool) -> None:
        with _in_transaction(using).cursor() as cursor:
            statement = insert_sql(table or outbox_table(), scheduled)
            if len(rows) == 1:
                cursor.execute(statement, rows[0])
            else:
                cursor.executemany(statement, rows)

    return insert


@spelled_out
def enqueue(
    *, table: str | None = None, using: str = DEFAULT_DB_ALIAS, **message: Unpack[MessageFields]
) -> uuid.UUID:
    """Write one message in the current ``atomic()`` block of ``using``; returns its id."""
    return write(_insert_on(using, table), [OutgoingMessage(**message)])[0]


def enqueue_many(
    messages: Iterable[OutgoingMessage],
    *,
    table: str | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> list[uuid.UUID]:
    """Write several messages in the current ``atomic()`` block (one executemany)."""
    return write(_insert_on(using, table), messages)


@spelled_out
def enqueue_json(
    *, table: str | None = None, using: str = DEFAULT_DB_ALIAS, **message: Unpack[JsonFields]
) -> uuid.UUID:
    """``enqueue`` with ``body`` serialised as JSON (content type application/json)."""
    return write(_insert_on(using, table), [json_message(**message)])[0]


def cancel(
    message_id: uuid.UUID, *, table: str | None = None, using: str = DEFAULT_DB_ALIAS
) -> bool:
    """``outbox.cancel`` in the current ``atomic()`` block of ``using``."""
    with _in_transaction(using).cursor() as cursor:
        cursor.execute(cancel_sql(table or outbox_table()), (message_id,))
        return bool(cursor.rowcount > 0)


def migrate_schema(
    connection: BaseDatabaseWrapper, table: str | None = None
) -> tuple[int | None, int]:
    """``outbox init`` on a Django database: (version before, version after).

    Outside a transaction (this package's Django migrations are not atomic, and
    ``manage.py outbox_init``) it runs online, as ``outbox init`` does, and says on
    stderr what it waits for; it does not resolve dead relays' batches (``outbox
    resolve`` or a running relay does).  Inside a transaction everything runs in
    that transaction, with no lock timeout.
    """
    table = table or outbox_table()

    def waiting(blocked: migrate.Blocked) -> None:
        print(f"outbox: {migrate.describe_wait(blocked, table)}", file=sys.stderr, flush=True)

    return migrate.migrate(_psycopg_connection(connection), table, on_blocked=waiting)
