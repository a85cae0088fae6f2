"""Outbox rows as the claim loads them (binary results, payloads as views).

A column that cannot be loaded never makes the claim fail: its value becomes a
placeholder and the row a dead letter naming the column (``message.Unloadable``).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg.adapt import Dumper, Loader, PyFormat
from psycopg.pq import Format
from psycopg.rows import tuple_row

from outbox.db.session import first_line
from outbox.message import ALL_LOADED, EPOCH, OutboxRow, Unloadable

Row = dict[str, Any]
Conn = psycopg.Connection[Row]


# The columns the claim returns (``queries.sql``, ``claim_batch``), in order: the
# fields of ``OutboxRow`` but ``unloadable``.  ``claimed_rows`` builds a row from
# them by position, without a dict per record.
CLAIM_COLUMNS = (
    "id",
    "message_id",
    "exchange",
    "routing_key",
    "payload",
    "headers",
    "content_type",
    "created_at",
    "ordering_key",
    "held_by",
)
# The columns of the claim's last record, which is not a row but where the next
# claim starts (``outbox.db.front``); NULL in the rows' records.
FRONT_COLUMNS = ("low_water", "late", "seen", "found")
_CLAIM_NAMES = tuple(name.encode() for name in (*CLAIM_COLUMNS, *FRONT_COLUMNS))
# The columns of the claim whose types ``claim_cursor`` loads tolerantly
# (timestamptz, jsonb): the only ones that can hold a value Python could not load.
TOLERANT_COLUMNS = ("created_at", "headers")


def claimed_rows(
    conn: Conn, cur: psycopg.Cursor[Any]
) -> tuple[list[OutboxRow], tuple[Any, ...] | None]:
    """The rows of a claim executed on ``cur`` (a ``claim_cursor``), in id order, and
    the values of its front record (``FRONT_COLUMNS``; None: no result); never raises
    for a row's content.

    A value that could not be loaded becomes an ``Unloadable`` holding PostgreSQL's
    own text of it (one round trip per such value; only bad rows have any) and the
    row a dead letter naming the column; the field holds a placeholder.  Only the
    claim's columns of the tolerant types can hold one (``TOLERANT_COLUMNS``):
    looking at every column of every row was a tenth of the relay's CPU."""
    # The result's own column names, not ``cur.description``: that builds a Column
    # object per column at every claim, a tenth of the claim's CPU at a few rows.
    result = cur.pgresult
    if result is None or result.nfields == 0:
        return [], None
    names = tuple(result.fname(i) for i in range(result.nfields))
    if names != _CLAIM_NAMES:
        raise AssertionError(f"the claim returned {names}, not {CLAIM_COLUMNS + FRONT_COLUMNS}")
    rows = []
    front = None
    for record in cur.fetchall():
        (id_, message_id, exchange, routing_key, payload, headers, content_type, created_at,
         ordering_key, held_by, low_water, late, seen, found) = record  # fmt: skip
        if id_ is None:
            front = (low_water, late, seen, found)
            continue
        if type(headers) is _Unloaded or type(created_at) is _Unloaded:
            rows.append(_partly_loaded(conn, record[: len(CLAIM_COLUMNS)]))
            continue
        rows.append(
            OutboxRow(
                id_,
                message_id,
                exchange,
                routing_key,
                payload,  # a view of the driver's result: no copy
                headers,
                content_type,
                created_at,
                ALL_LOADED,
                ordering_key,
                held_by,
            )
        )
    rows.sort(key=_by_id)
    return rows, front


_by_id = operator.attrgetter("id")


def _partly_loaded(conn: Conn, record: Sequence[Any]) -> OutboxRow:
    values = dict(zip(CLAIM_COLUMNS, record, strict=True))
    unloadable = {
        column: _text_of(conn, value)
        for column in TOLERANT_COLUMNS
        if isinstance(value := values[column], _Unloaded)
    }
    if "headers" in unloadable:
        values["headers"] = None
    if "created_at" in unloadable:
        values["created_at"] = EPOCH
    return OutboxRow(**values, unloadable=unloadable)


@dataclasses.dataclass(frozen=True)
class _Unloaded:
    """A binary value Python could not load, as PostgreSQL sent it (``raw``);
    ``claimed_rows`` asks the server for its text, which the dead letter keeps."""

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


class _TolerantTimestampLoader(_TolerantLoader):
    """timestamptz, tolerantly, and equal values as one object: the rows of one
    transaction share their ``created_at`` (its ``now()``).  Loaded once, not once
    per row, and the AMQP timestamp is then computed once (``outbox.amqp.frames``)."""

    _last: tuple[bytes, Any] = (b"", None)

    def load(self, data: Any) -> Any:
        raw = bytes(data)  # 8 bytes
        last = self._last
        if raw == last[0]:
            return last[1]
        value = super().load(data)
        self._last = (raw, value)
        return value


@functools.cache
def _tolerant(inner: type[Loader], base: type[_TolerantLoader] = _TolerantLoader) -> type[Loader]:
    return type(f"Tolerant{inner.__name__}", (base,), {"inner": inner})


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


def claim_cursor(conn: Conn) -> psycopg.Cursor[tuple[Any, ...]]:
    """A binary cursor: a payload arrives as its bytes, not as hex text twice its
    size (plus a decoded copy), and stays in the driver's result (``_PayloadLoader``).

    timestamptz and jsonb values that cannot be loaded come back as ``_Unloaded``
    instead of failing the whole fetch.  Records are tuples (``claimed_rows``).
    """
    cur = conn.cursor(binary=True, row_factory=tuple_row)
    for type_name, base in (
        ("timestamptz", _TolerantTimestampLoader),
        ("jsonb", _TolerantLoader),
    ):
        info = cur.adapters.types[type_name]
        inner = cur.adapters.get_loader(info.oid, Format.BINARY)
        if inner is not None and not issubclass(inner, _TolerantLoader):
            cur.adapters.register_loader(info.oid, _tolerant(inner, base))
    cur.adapters.register_loader("bytea", _PayloadLoader)
    return cur


def _text_of(conn: Conn, value: _Unloaded) -> Unloadable:
    """PostgreSQL's own text of a value Python could not load (one round trip)."""
    cur = conn.cursor()
    cur.adapters.register_dumper(_Unloaded, _RawDumper)
    row = cur.execute("SELECT %b::text AS text", [value]).fetchone()
    return Unloadable(row["text"] if row else "", value.error)
