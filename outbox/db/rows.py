"""Outbox rows as the claim loads them (binary results, payloads as views).

A column that cannot be loaded never makes the claim fail: its value becomes a
placeholder and the row a dead letter naming the column (``message.Unloadable``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import psycopg
from psycopg.adapt import Dumper, Loader, PyFormat
from psycopg.pq import Format

from outbox.db.session import first_line
from outbox.message import EPOCH, OutboxRow, Unloadable

Row = dict[str, Any]
Conn = psycopg.Connection[Row]


# The columns of the claim whose types ``claim_cursor`` loads tolerantly
# (timestamptz, jsonb): the only ones that can hold a value Python could not load.
TOLERANT_COLUMNS = ("created_at", "headers")


def outbox_row(record: Row) -> OutboxRow:
    """An OutboxRow from a claimed record; never raises (see ``claim_cursor``)."""
    unloadable = {
        column: value
        for column in TOLERANT_COLUMNS
        if isinstance(value := record[column], Unloadable)
    }
    return OutboxRow(
        id=record["id"],
        message_id=record["message_id"],
        exchange=record["exchange"],
        routing_key=record["routing_key"],
        payload=record["payload"],  # a view of the driver's result: no copy
        headers=None if "headers" in unloadable else record["headers"],
        content_type=record["content_type"],
        created_at=EPOCH if "created_at" in unloadable else record["created_at"],
        unloadable=unloadable,
        ordering_key=record["ordering_key"],
        held_by=record["held_by"],
    )


@dataclasses.dataclass(frozen=True)
class _Unloaded:
    """A binary value Python could not load, as PostgreSQL sent it (``raw``);
    ``with_texts`` asks the server for its text, which the dead letter keeps."""

    oid: int
    raw: bytes
    error: str


class _TolerantLoader(Loader):
    """Loads like ``inner``, but a value it cannot load becomes ``_Unloaded``.

    psycopg raises DataError for timestamps Python cannot hold ('infinity',
    '-infinity', BC, after year 9999) and the JSON loader RecursionError for
    deep nesting, in the middle of fetching a batch: one such row would stop the
    relay on every start.  The row becomes a dead letter instead.
    """

    inner: type[Loader]
    format = Format.BINARY

    def __init__(self, oid: int, context: Any = None) -> None:
        super().__init__(oid, context)
        self._inner = self.inner(oid, context)

    def load(self, data: Any) -> Any:
        try:
            return self._inner.load(data)
        except (psycopg.DataError, ValueError, OverflowError, RecursionError) as exc:
            return _Unloaded(self.oid, bytes(data), first_line(exc))


@functools.cache
def _tolerant(inner: type[Loader]) -> type[Loader]:
    return type(f"Tolerant{inner.__name__}", (_TolerantLoader,), {"inner": inner})


class _PayloadLoader(Loader):
    """bytea as a read-only view of the driver's result, not a copy of it.

    The view keeps the result alive (psycopg's C implementation hands Python
    loaders a memoryview that holds a reference to the PGresult); the pure-Python
    implementation hands over bytes, which are returned as they are.
    """

    format = Format.BINARY

    def load(self, data: Any) -> Any:
        return data


class _RawDumper(Dumper):
    """Sends an ``_Unloaded`` value back in the binary form PostgreSQL sent it."""

    format = Format.BINARY

    def dump(self, obj: Any) -> bytes:
        return bytes(obj.raw)

    def get_key(self, obj: Any, format: PyFormat) -> Any:
        return (type(self), obj.oid)

    def upgrade(self, obj: Any, format: PyFormat) -> Dumper:
        dumper = type(self)(type(obj))
        dumper.connection, dumper.oid = self.connection, obj.oid
        return dumper


def claim_cursor(conn: Conn) -> psycopg.Cursor[Row]:
    """A binary cursor: a payload arrives as its bytes, not as hex text twice its
    size (plus a decoded copy), and stays in the driver's result (``_PayloadLoader``).

    timestamptz and jsonb values that cannot be loaded come back as ``_Unloaded``
    instead of failing the whole fetch.
    """
    cur = conn.cursor(binary=True)
    for type_name in ("timestamptz", "jsonb"):
        info = cur.adapters.types[type_name]
        inner = cur.adapters.get_loader(info.oid, Format.BINARY)
        if inner is not None and not issubclass(inner, _TolerantLoader):
            cur.adapters.register_loader(info.oid, _tolerant(inner))
    cur.adapters.register_loader("bytea", _PayloadLoader)
    return cur


def with_texts(conn: Conn, records: list[Row]) -> list[Row]:
    """Replace each ``_Unloaded`` value by an ``Unloadable`` holding PostgreSQL's own
    text of it (one round trip per such value; only bad rows have any).

    Only the claim's columns of the tolerant types can hold one (``TOLERANT_COLUMNS``):
    looking at every column of every row was a tenth of the relay's CPU."""
    for record in records:
        for column in TOLERANT_COLUMNS:
            value = record.get(column)
            if isinstance(value, _Unloaded):
                cur = conn.cursor()
                cur.adapters.register_dumper(_Unloaded, _RawDumper)
                row = cur.execute("SELECT %b::text AS text", [value]).fetchone()
                text = row["text"] if row else ""
                record[column] = Unloadable(text, value.error)
    return records
