import datetime
import uuid

import pika
import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox.message import MAX_HEADER_DEPTH, SENDER_SELECTED, OutboxRow, Unloadable, problem_with

MAX = 1024


def row(**changes: object) -> OutboxRow:
    fields: dict[str, object] = dict(
        id=1,
        message_id=uuid.uuid4(),
        exchange="orders",
        routing_key="order.created",
        payload=b"{}",
        headers=None,
        content_type="application/json",
        created_at=datetime.datetime.now(datetime.timezone.utc),
    )
    fields.update(changes)
    return OutboxRow(**fields)  # type: ignore[arg-type]


def test_problem_with__accepts_a_normal_row() -> None:
    assert problem_with(row(headers={"a": 1, "b": [True, None, "x"], "c": {"d": -5}}), MAX) is None


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"exchange": "e" * 256}, "exchange is 256 bytes"),
        ({"routing_key": "é" * 128}, "routing_key is 256 bytes"),
        ({"content_type": "t" * 300}, "content_type is 300 bytes"),
        ({"payload": b"x" * (MAX + 1)}, "payload is 1025 bytes"),
        ({"headers": {"price": 1.5}}, "header headers.price is a floating-point"),
        ({"headers": {"n": 2**64}}, "outside the 64-bit range"),
        ({"headers": {"list": [1, {"deep": 0.1}]}}, "headers.list[1].deep"),
        ({"headers": ["not", "an", "object"]}, "headers must be a JSON object"),
        ({"headers": {"CC": "one.key"}}, "header CC must be an array"),
        ({"headers": {"BCC": {"a": 1}}}, "header BCC must be an array"),
        (
            {"created_at": datetime.datetime(1969, 12, 31, 23, 59, tzinfo=datetime.timezone.utc)},
            "created_at 1969-12-31T23:59:00+00:00 is before 1970",
        ),
        (
            {
                "unloadable": {
                    "created_at": Unloadable(
                        "infinity", "timestamp too large (after year 10K): 'infinity'"
                    )
                }
            },
            "created_at cannot be loaded: timestamp too large (after year 10K): 'infinity'",
        ),
        (
            {"unloadable": {"headers": Unloadable('{"d": [[[[', "maximum recursion depth")}},
            """headers cannot be loaded: maximum recursion depth (value '{"d": [[[[')""",
        ),
    ],
)
def test_problem_with__names_the_reason(changes: dict[str, object], reason: str) -> None:
    problem = problem_with(row(**changes), MAX)
    assert problem is not None and reason in problem


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=10), children, max_size=3)
    ),
    max_leaves=10,
)


@given(
    st.dictionaries(
        st.text(max_size=10).filter(lambda k: k not in SENDER_SELECTED), json_values, max_size=4
    )
)
def test_problem_with__agrees_with_pika_on_headers(headers: dict[str, object]) -> None:
    """A row passes exactly when pika can encode its headers (CC and BCC aside:
    RabbitMQ, not pika, refuses those when they are not arrays)."""
    verdict = problem_with(row(headers=headers), MAX)
    try:
        pika.BasicProperties(headers=headers).encode()
        encodable = True
    except Exception:
        encodable = False
    assert (verdict is None) == encodable, verdict


def test_problem_with__accepts_the_deepest_allowed_headers_and_the_year_9999() -> None:
    deepest: object = "leaf"
    for _ in range(MAX_HEADER_DEPTH - 1):
        deepest = [deepest]
    late = datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.timezone.utc)
    assert problem_with(row(headers={"d": deepest}, created_at=late), MAX) is None
    pika.BasicProperties(headers={"d": deepest}).encode()


@given(st.integers(MAX_HEADER_DEPTH, 20_000), st.booleans())
def test_problem_with__any_nesting_depth_is_a_reason_never_a_crash(
    depth: int, objects: bool
) -> None:
    nested: object = 1
    for _ in range(depth):
        nested = {"k": nested} if objects else [nested]
    problem = problem_with(row(headers={"d": nested}), MAX)
    assert problem == f"headers nest deeper than {MAX_HEADER_DEPTH} levels"


@given(
    created_at=st.datetimes(
        min_value=datetime.datetime(1969, 12, 29),
        max_value=datetime.datetime(1971, 1, 3),
        timezones=st.timezones(),
    ),
    routing_key=st.text(max_size=300),
)
def test_problem_with__the_shortcuts_agree_with_the_rules(
    created_at: datetime.datetime, routing_key: str
) -> None:
    """A year after 1970 and a short string skip the exact checks: near the edges
    (time zones around 1970, characters of up to 4 bytes) the verdict is the same."""
    try:
        size = len(routing_key.encode("utf-8"))
    except UnicodeEncodeError:
        return  # a lone surrogate: PostgreSQL text never holds one
    epoch = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
    problem = problem_with(row(created_at=created_at, routing_key=routing_key), MAX) or ""
    assert ("before 1970" in problem) == (created_at < epoch)
    if created_at >= epoch:
        assert ("routing_key is" in problem) == (size > 255)
