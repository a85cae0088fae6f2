from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox.message import refusal_in
from outbox.ops.deadletters import Selection, parse_age, parse_ids


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90),
        ("90s", 90),
        ("15m", 900),
        ("12h", 43200),
        ("30d", 2592000),
        ("2W", 1209600),
        ("1.5h", 5400),
        (" 7d ", 604800),
    ],
)
def test_parse_age__units(text: str, seconds: float) -> None:
    assert parse_age(text) == seconds


@pytest.mark.parametrize("text", ["", "d", "-1d", "3 days", "1y", "1e3"])
def test_parse_age__rejects_what_is_not_an_age(text: str) -> None:
    with pytest.raises(ValueError, match="not an age"):
        parse_age(text)


@given(st.integers(min_value=0, max_value=10**6))
def test_parse_age__days_are_86400_seconds(days: int) -> None:
    assert parse_age(f"{days}d") == days * 86400


def test_parse_ids__names_the_bad_one() -> None:
    with pytest.raises(ValueError, match="'nope' is not a message id"):
        parse_ids(["0d9c6d4e-3f0e-4a8e-9b1a-2f0a4f7b8c11", "nope"])


def test_parse_ids__numbers_are_row_ids_and_uuids_message_ids() -> None:
    message_id = uuid.UUID("0d9c6d4e-3f0e-4a8e-9b1a-2f0a4f7b8c11")
    selection = parse_ids([str(message_id), "42", "7"])
    assert selection == Selection((message_id,), (42, 7))
    touched = [{"id": 42, "message_id": message_id}, {"id": 43, "message_id": message_id}]
    assert selection.not_found(touched) == ["7"]


def test_refusal_in__configured_max_message_size() -> None:
    refusal = refusal_in(
        "channel closed: 406 PRECONDITION_FAILED - message size 5000 is larger than "
        "configured max size 4096"
    )
    assert refusal is not None
    assert refusal.max_message_bytes == 4096 and refusal.exchange is None


def test_refusal_in__hard_max_message_size() -> None:
    refusal = refusal_in(
        "406 PRECONDITION_FAILED - message size 600000000 is larger than max size 536870912"
    )
    assert refusal is not None and refusal.max_message_bytes == 536870912


@pytest.mark.parametrize(
    "reason",
    [
        "403 ACCESS_REFUSED - cannot publish to internal exchange 'audit.x' in vhost '/'",
        "403 ACCESS_REFUSED - write access to exchange 'audit.x' in vhost 'v' "
        "refused for user 'relay'",
    ],
)
def test_refusal_in__exchange_refusing_publishes(reason: str) -> None:
    refusal = refusal_in(reason)
    assert refusal is not None and refusal.exchange == "audit.x"


@pytest.mark.parametrize(
    "reason",
    [
        "nacked by the broker",
        "no confirm before the publish timeout",
        "channel closed: 404 NOT_FOUND - no exchange 'x' in vhost '/'",
        "channel closed: 320 CONNECTION_FORCED - broker forced connection closure",
        "406 PRECONDITION_FAILED - inequivalent arg 'durable'",
    ],
)
def test_refusal_in__transient_or_other_reasons_are_not_refusals(reason: str) -> None:
    assert refusal_in(reason) is None


def test_parse_ids__what_no_row_can_hold_is_refused_before_the_database_sees_it() -> None:
    # Sent as they were, PostgreSQL failed the statement ("bigint out of range",
    # "text fields cannot contain NUL"): a traceback in the CLI, a 500 in the console.
    with pytest.raises(ValueError, match="'99999999999999999999' is not a row id"):
        parse_ids(["99999999999999999999"])
    assert parse_ids([str(2**63 - 1)]).row_ids == (2**63 - 1,)
    with pytest.raises(ValueError, match="NUL"):
        parse_ids([], ["a\x00b"])
