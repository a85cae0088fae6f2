"""The AMQP properties of a delivery, as they arrived on the wire (pure).

py-amqp decodes a content header's property list with UTF-8 and raises on a short
string that is not UTF-8 (a ``message_id`` of ``b'\\xff\\xfe'``), inside the
connection's frame reader, so one such message stopped the consumer on every
start.  ``decode`` reads the same list and never fails on text: a short string
that is not UTF-8 stays ``bytes``.  It also returns the list's raw bytes, which a
parked message keeps so that ``outbox parked retry`` sends back exactly what
arrived (``for_retry``): the same flags, the same property values, the same
header table entries with the same AMQP types, only marked persistent, without its
expiration (a TTL could drop it before a consumer runs) and with the two headers
that say where the message first came from.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

from amqp.serialization import dumps, loads

from outbox.amqp.message import UNREADABLE_PROPERTIES

# (flag bit, property, AMQP type) of the basic class, in wire order.
# s: short string, o: octet, F: field table, T: timestamp (seconds).
FIELDS = (
    (0x8000, "content_type", "s"),
    (0x4000, "content_encoding", "s"),
    (0x2000, "application_headers", "F"),
    (0x1000, "delivery_mode", "o"),
    (0x0800, "priority", "o"),
    (0x0400, "correlation_id", "s"),
    (0x0200, "reply_to", "s"),
    (0x0100, "expiration", "s"),
    (0x0080, "message_id", "s"),
    (0x0040, "timestamp", "T"),
    (0x0020, "type", "s"),
    (0x0010, "user_id", "s"),
    (0x0008, "app_id", "s"),
    (0x0004, "cluster_id", "s"),
)
HEADERS_FLAG = 0x2000
DELIVERY_MODE_FLAG = 0x1000
EXPIRATION_FLAG = 0x0100
PERSISTENT = 2

# Bytes after the type letter of a fixed-size field-table value.
_FIXED = {
    **dict.fromkeys("tbB", 1),
    **dict.fromkeys("sUu", 2),
    **dict.fromkeys("Iif", 4),
    **dict.fromkeys("LldT", 8),
    "D": 5,
    "V": 0,
}


def decode(buf: bytes | bytearray | memoryview, offset: int = 0) -> tuple[dict[str, Any], int]:
    """The properties at ``offset`` and the offset after them.  Short strings that
    are UTF-8 are ``str`` (as py-amqp gives them), others stay ``bytes``.  A header
    table py-amqp cannot read is left out, with ``UNREADABLE_PROPERTIES`` saying why
    (the message is parked, under its message_id)."""
    data = bytes(buf)
    (flags,) = struct.unpack_from(">H", data, offset)
    offset += 2
    properties: dict[str, Any] = {}
    for flag, name, kind in FIELDS:
        if not flags & flag:
            continue
        if kind == "s":
            length = data[offset]
            raw = data[offset + 1 : offset + 1 + length]
            offset += 1 + length
            try:
                properties[name] = raw.decode("utf-8")
            except UnicodeDecodeError:
                properties[name] = raw
        elif kind == "o":
            properties[name] = data[offset]
            offset += 1
        elif kind == "T":
            (properties[name],) = struct.unpack_from(">Q", data, offset)
            offset += 8
        else:
            try:
                (properties[name],), offset = loads("F", data, offset)
            except Exception as exc:
                # py-amqp cannot read a value (a timestamp past year 9999, a table
                # nested too deep): skip the table, still read the message_id.
                (length,) = struct.unpack_from(">I", data, offset)
                offset += 4 + length
                properties[UNREADABLE_PROPERTIES] = (
                    f"application_headers: {type(exc).__name__}: {exc}"
                )
    if offset > len(data):
        raise ValueError("the property list ends early")
    return properties, offset


def encode(properties: Mapping[str, Any]) -> bytes:
    """A property list with ``properties`` (``decode``'s inverse for the fields it
    reads): for a delivery whose list did not arrive as bytes (a test's double)."""
    flags = 0
    out = bytearray()
    for flag, name, kind in FIELDS:
        value = properties.get(name)
        if value is None:
            continue
        flags |= flag
        if kind == "s":
            raw = value if isinstance(value, bytes) else str(value).encode("utf-8")
            out += bytes([len(raw)]) + raw
        elif kind == "o":
            out.append(int(value))
        elif kind == "T":
            out += struct.pack(">Q", int(value))
        else:
            out += bytes(dumps("F", [dict(value)]))
    return struct.pack(">H", flags) + bytes(out)


def _table_entries(data: bytes, start: int, end: int) -> list[tuple[bytes, bytes]]:
    """(key, encoded value) of each entry of a field table's body."""
    entries = []
    offset = start
    while offset < end:
        key_length = data[offset]
        key = data[offset + 1 : offset + 1 + key_length]
        offset += 1 + key_length
        value_start = offset
        offset = _skip_value(data, offset)
        entries.append((key, data[value_start:offset]))
    return entries


def _skip_value(data: bytes, offset: int) -> int:
    kind = chr(data[offset])
    offset += 1
    if kind in _FIXED:
        return offset + _FIXED[kind]
    if kind in "SxFA":
        (length,) = struct.unpack_from(">I", data, offset)
        return offset + 4 + int(length)
    raise ValueError(f"unknown AMQP field type {kind!r}")


def _encode_entry(key: str, value: Any) -> bytes:
    return bytes(dumps("F", [{key: value}]))[4:]  # without the table's 4-byte length


def for_retry(raw: bytes, extra_headers: Mapping[str, Any]) -> bytes:
    """``raw`` (a property list as ``decode`` read it) marked persistent, without
    its per-message TTL (``expiration``: a retried message must not expire in the
    queue while no consumer runs, it would be nowhere), with ``extra_headers`` set
    in its header table (replacing entries of the same keys); every other byte as
    it was."""
    (flags,) = struct.unpack_from(">H", raw, 0)
    offset = 2
    out = bytearray()
    new_flags = (flags | HEADERS_FLAG | DELIVERY_MODE_FLAG) & ~EXPIRATION_FLAG
    replaced = {k.encode() for k in extra_headers}
    added = b"".join(_encode_entry(k, v) for k, v in extra_headers.items())
    for flag, _name, kind in FIELDS:
        if flag == HEADERS_FLAG:
            entries = b""
            if flags & flag:
                (length,) = struct.unpack_from(">I", raw, offset)
                body_start = offset + 4
                offset = body_start + length
                entries = b"".join(
                    bytes([len(key)]) + key + value
                    for key, value in _table_entries(raw, body_start, offset)
                    if key not in replaced
                )
            table = entries + added
            out += struct.pack(">I", len(table)) + table
            continue
        if flag == DELIVERY_MODE_FLAG:
            if flags & flag:
                offset += 1
            out.append(PERSISTENT)
            continue
        if not flags & flag:
            continue
        if flag == EXPIRATION_FLAG:
            offset += 1 + raw[offset]
            continue
        start = offset
        if kind == "s":
            offset += 1 + raw[offset]
        elif kind == "o":
            offset += 1
        elif kind == "T":
            offset += 8
        out += raw[start:offset]
    return struct.pack(">H", new_flags) + bytes(out)
