"""Pure parts that make any message storable: the inbox key of a message id (one to
one), the AMQP property list read without failing on text, and the same list sent
back by ``parked retry`` with only the routing headers and persistence changed."""

from __future__ import annotations

import struct

import amqp
from hypothesis import given
from hypothesis import strategies as st

from outbox.amqp import properties as wire
from outbox.amqp.message import (
    MAX_JSON_DEPTH,
    NESTED_TOO_DEEP,
    inbox_key,
    json_safe,
    key_bytes,
    text_safe,
    to_inbox_message,
)


@given(st.binary(max_size=255))
def test_inbox_key__is_text_postgresql_accepts_and_gives_the_bytes_back(raw: bytes) -> None:
    key = inbox_key(raw)
    assert "\x00" not in key
    key.encode("utf-8")  # no lone surrogates
    assert key_bytes(key) == raw


@given(st.binary(max_size=40), st.binary(max_size=40))
def test_inbox_key__two_ids_share_a_key_only_when_equal(a: bytes, b: bytes) -> None:
    assert (inbox_key(a) == inbox_key(b)) == (a == b)


def test_inbox_key__ordinary_ids_are_recorded_as_they_are() -> None:
    assert inbox_key("8d5d6f0e-uuid") == "8d5d6f0e-uuid" == inbox_key(b"8d5d6f0e-uuid")
    assert inbox_key(b"\xff\xfe-bad") == "\\xfffe2d626164"
    assert inbox_key("a\x00b") == "\\x610062"
    assert inbox_key("\\xlooks") == "\\x" + b"\\xlooks".hex()


@given(st.text())
def test_text_safe__never_holds_nul_or_lone_surrogates(text: str) -> None:
    safe = text_safe(text)
    assert "\x00" not in safe
    safe.encode("utf-8")


def test_json_safe__nul_bytes_and_nested_values_become_storable_text() -> None:
    value = {b"k\xff": [b"\x00\x01", "a\x00b", {"n": float("nan")}]}
    assert json_safe(value) == {"k\\udcff": ["\\x00\x01", "a\\x00b", {"n": "NaN"}]}


values = st.recursive(
    st.one_of(
        st.text(max_size=20),
        st.binary(max_size=20),
        st.integers(-(2**31), 2**31 - 1),
        st.booleans(),
        st.none(),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=10,
)


def _encoded(headers: dict[str, object], message_id: bytes) -> bytes:
    """A property list as a client writes it: py-amqp's, with a raw message_id."""
    body = amqp.Message(b"", application_headers=headers, content_type="t/x")
    raw = bytes(body._serialize_properties())
    (flags,) = struct.unpack_from(">H", raw, 0)
    _, end = wire.decode(raw)
    assert end == len(raw)
    return struct.pack(">H", flags | 0x0080) + raw[2:] + bytes([len(message_id)]) + message_id


@given(
    st.dictionaries(st.text(min_size=1, max_size=10), values, max_size=4), st.binary(max_size=60)
)
def test_decode__reads_any_property_list_and_keeps_its_bytes(
    headers: dict[str, object], message_id: bytes
) -> None:
    raw = _encoded(headers, message_id)
    props, end = wire.decode(raw)
    assert end == len(raw)
    got = props["message_id"]
    assert (got.encode("utf-8") if isinstance(got, str) else got) == message_id
    message = to_inbox_message(b"", props, {}, "q", raw_properties=raw)
    assert message.message_id == inbox_key(message_id) or not message_id


@given(
    st.dictionaries(st.text(min_size=1, max_size=10), values, max_size=4), st.binary(max_size=60)
)
def test_for_retry__changes_only_persistence_and_the_routing_headers(
    headers: dict[str, object], message_id: bytes
) -> None:
    raw = _encoded(headers, message_id)
    extra = {"x-outbox-original-exchange": "orders", "x-outbox-original-routing-key": "k"}
    again = wire.for_retry(raw, extra)
    before, _ = wire.decode(raw)
    after, end = wire.decode(again)
    assert end == len(again)
    assert after.pop("delivery_mode") == 2
    assert after.pop("application_headers") == {**before.pop("application_headers"), **extra}
    assert after == before
    # Sent back a second time (parked again): still one entry per routing header.
    assert (
        wire.decode(wire.for_retry(again, extra))[0]["application_headers"]
        == (wire.decode(again)[0]["application_headers"])
    )


def test_decode__a_bytes_header_stays_bytes_and_keeps_its_type_on_retry() -> None:
    # 'x' (byte array) as pika writes bytes: py-amqp would write it back as 'S'.
    table = b"\x03bin" + b"x" + struct.pack(">I", 2) + b"\x00\x01"
    raw = struct.pack(">H", 0x2000) + struct.pack(">I", len(table)) + table
    again = wire.for_retry(raw, {"h": "v"})
    assert table in again
    assert wire.decode(again)[0]["application_headers"]["bin"] == b"\x00\x01"


def test_json_safe__tables_nested_deeper_than_the_limit_are_shown_as_text() -> None:
    deep: object = [b"\x00"]
    for i in range(2000):
        deep = {"k": deep} if i % 2 else [deep]
    shown = json_safe({"h": deep})
    for _ in range(MAX_JSON_DEPTH):
        assert isinstance(shown, (dict, list))
        shown = (
            shown["k"]
            if isinstance(shown, dict) and "k" in shown
            else (shown["h"] if isinstance(shown, dict) else shown[0])
        )
    assert shown == NESTED_TOO_DEEP


def test_for_retry__drops_the_expiration_and_keeps_what_follows_it() -> None:
    raw = bytes(
        amqp.Message(b"", expiration="1000", message_id="m", priority=4)._serialize_properties()
    )
    again = wire.for_retry(raw, {})
    after, end = wire.decode(again)
    assert end == len(again)
    before, _ = wire.decode(raw)
    assert before.pop("expiration") == "1000"
    assert after.pop("delivery_mode") == 2
    assert after.pop("application_headers") == {}
    assert after == before
