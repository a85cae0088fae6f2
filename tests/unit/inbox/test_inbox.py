"""Pure parts of the consumer's inbox: the handler's view of a delivery, retry
delays, settings, bindings, handler loading, the inbox SQL and health decisions."""

from __future__ import annotations

import datetime
import decimal
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox.amqp.message import (
    ORIGINAL_EXCHANGE_HEADER,
    ORIGINAL_ROUTING_KEY_HEADER,
    json_safe,
    to_inbox_message,
)
from outbox.db.inbox import describe, render_sql
from outbox.errors import ExitCode
from outbox.inbox.handlers import HandlerNotFound, load_handler
from outbox.inbox.metrics import liveness_limit, readiness
from outbox.inbox.planning import retry_delay
from outbox.inbox.settings import ConsumerSettings, parse_bindings
from outbox.inbox.steps import parking_for

DELIVERY = {"exchange": "orders", "routing_key": "order.created", "redelivered": False}


def test_message__carries_id_body_headers_route_and_ordering_key() -> None:
    message = to_inbox_message(
        b'{"id": 1}',
        {
            "message_id": "m-1",
            "content_type": "application/json",
            "application_headers": {"x-ordering-key": "order-7", "tenant": "acme"},
        },
        {**DELIVERY, "redelivered": True},
        "billing",
    )
    assert (message.message_id, message.body, message.queue) == ("m-1", b'{"id": 1}', "billing")
    assert (message.exchange, message.routing_key) == ("orders", "order.created")
    assert message.ordering_key == "order-7"
    assert message.headers == {"x-ordering-key": "order-7", "tenant": "acme"}
    assert message.redelivered is True
    assert message.json() == {"id": 1}
    assert message.content_type == "application/json"


@pytest.mark.parametrize("missing", [{}, {"message_id": None}, {"message_id": ""}])
def test_message__without_an_id_has_message_id_none(missing: dict[str, object]) -> None:
    message = to_inbox_message(b"", missing, DELIVERY, "q")
    assert message.message_id is None and message.ordering_key is None


def test_message__a_retried_parked_message_shows_where_it_first_came_from() -> None:
    headers = {
        ORIGINAL_EXCHANGE_HEADER: "orders",
        ORIGINAL_ROUTING_KEY_HEADER: "order.paid",
        "tenant": "acme",
    }
    message = to_inbox_message(
        b"x",
        {"message_id": "m", "application_headers": headers},
        {"exchange": "", "routing_key": "billing"},
        "billing",
    )
    assert (message.exchange, message.routing_key) == ("orders", "order.paid")
    assert message.headers == {"tenant": "acme"}


def test_parking__keeps_headers_and_properties_as_json() -> None:
    when = datetime.datetime(2024, 5, 1, 12, 0, 0)
    message = to_inbox_message(
        b"x",
        {
            "message_id": "m",
            "timestamp": when,
            "delivery_mode": 2,
            "application_headers": {"raw": b"\xff", "n": decimal.Decimal("1.5"), "l": [1, b"a"]},
        },
        DELIVERY,
        "q",
    )
    parking = parking_for(message, "ValueError: no")
    assert parking.headers == {"raw": "\ufffd", "n": "1.5", "l": [1, "a"]}
    assert parking.properties == {"timestamp": "2024-05-01T12:00:00"}  # delivery_mode is ours
    assert (parking.exchange, parking.routing_key, parking.queue) == (
        "orders",
        "order.created",
        "q",
    )


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.binary() | st.text(),
        lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
    )
)
def test_json_safe__always_gives_json(value: object) -> None:
    import json

    json.dumps(json_safe(value))


@given(st.integers(min_value=1, max_value=100))
def test_retry_delay__grows_and_is_capped(attempts: int) -> None:
    settings = ConsumerSettings(queue="q", retry_delay=0.1, retry_delay_max=5.0)
    delay = retry_delay(attempts, settings)
    ceiling = min(5.0, 0.1 * 2 ** (attempts - 1))
    assert ceiling / 2 <= delay <= ceiling


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"queue": ""}, "queue"),
        ({"inbox_table": "Inbox-1"}, "not valid"),
        ({"prefetch": 0}, "prefetch"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"inbox_retention": 0}, "retention"),
    ],
)
def test_settings__refuse_what_cannot_work(change: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        ConsumerSettings(**{"queue": "q", **change})


def test_settings__the_consumer_name_defaults_to_the_queue() -> None:
    assert ConsumerSettings(queue="billing").consumer == "billing"
    assert ConsumerSettings(queue="billing.3", consumer_name="billing").consumer == "billing"


def test_bindings__exchange_and_key_with_hash_by_default() -> None:
    assert parse_bindings(["orders:order.*", "audit", "a:b:c"]) == (
        ("orders", "order.*"),
        ("audit", "#"),
        ("a", "b:c"),
    )
    with pytest.raises(ValueError, match="EXCHANGE:BINDING_KEY"):
        parse_bindings([":key"])


def test_load_handler__imports_module_function_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "obx_test_handlers.py").write_text(
        "def on_order(conn, message):\n    return 'called'\nnot_callable = 3\n"
        "class Group:\n    @staticmethod\n    def nested(conn, message):\n        return 'nested'\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert load_handler("obx_test_handlers:on_order")(None, None) == "called"
    assert load_handler("obx_test_handlers:Group.nested")(None, None) == "nested"
    for spec, words in [
        ("obx_test_handlers", "MODULE:FUNCTION"),
        ("obx_no_such_module:f", "cannot import module"),
        ("obx_test_handlers:missing", "has no 'missing'"),
        ("obx_test_handlers:not_callable", "not callable"),
    ]:
        with pytest.raises(HandlerNotFound, match=words) as caught:
            load_handler(spec)
        assert caught.value.exit_code == ExitCode.USAGE


def test_load_handler__a_module_that_fails_to_import_says_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "obx_broken_handlers.py").write_text("x = 1\nraise RuntimeError('bad config')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(HandlerNotFound, match=r"RuntimeError: bad config \(.*:2\)"):
        load_handler("obx_broken_handlers:f")


def test_describe__type_message_and_where_it_was_raised() -> None:
    try:
        raise ValueError("first line\nsecond line")
    except ValueError as exc:
        text = describe(exc)
    assert text.startswith("ValueError: first line (") and "test_inbox.py:" in text


def test_render_sql__creates_the_three_tables_idempotently() -> None:
    text = render_sql("billing_inbox")
    for table in ("billing_inbox", "billing_inbox_attempts", "billing_inbox_parked"):
        assert f'CREATE TABLE IF NOT EXISTS "{table}"' in text
    assert text.startswith("-- outbox consume") and "COMMIT;" in text


def test_readiness__names_each_problem() -> None:
    assert readiness(stopping=False, database_ok=True, broker_connected=True, last_error=None).ok
    check = readiness(stopping=True, database_ok=False, broker_connected=False, last_error="x")
    assert not check.ok and len(check.problems) == 4
    assert "stopping" in check.body() and "database" in check.body()


def test_liveness_limit__covers_a_retry_a_backoff_reconnects_and_two_heartbeats() -> None:
    settings = ConsumerSettings(queue="q")
    assert liveness_limit(settings) == 5.0 + 30.0 + 2 * 10.0 + 2 * 60 + 60.0


@pytest.mark.parametrize(("prefetch", "batch"), [(1, 1), (2, 1), (3, 1), (10, 5), (200, 100)])
def test_settings__a_batch_takes_half_the_prefetch(prefetch: int, batch: int) -> None:
    assert ConsumerSettings(queue="q", prefetch=prefetch).batch_size == batch


def test_settings__the_default_prefetch_keeps_a_full_batch_in_the_socket() -> None:
    settings = ConsumerSettings(queue="q")
    assert settings.prefetch == 200 and settings.batch_size == 100


def test_parked_retry_pages__fill_the_byte_budget_and_take_a_larger_body_alone() -> None:
    from outbox.inbox.parked import fitting

    assert fitting([(1, 10), (2, 10), (3, 10)], 25) == [1, 2]
    assert fitting([(1, 10), (2, 15), (3, 1)], 25) == [1, 2]
    assert fitting([(7, 100), (8, 1)], 25) == [7]  # alone: never an empty page
    assert fitting([(1, 30), (2, 1)], 25) == [1]
    assert fitting([(1, 1), (2, 30)], 25) == [1]


def test_parked_retry__original_keys_are_the_bytes_that_arrived() -> None:
    from outbox.amqp.message import inbox_key
    from outbox.inbox.parked import original_key

    assert original_key("orders.created") == b"orders.created"
    assert original_key("é") == "é".encode()
    # The escape of the bytes themselves (bytes that are not UTF-8: not decodable).
    assert original_key("\\xff00fe") == b"\xff\x00\xfe"
    # As the consumer records a key it read with surrogateescape.
    read = b"a\xff\x00\xfe".decode("utf-8", "surrogateescape")
    assert original_key(inbox_key(read)) == b"a\xff\x00\xfe"
    # A lone surrogate no byte became: its UTF-8 with surrogates, as recorded.
    assert original_key(inbox_key("\ud800")) == "\ud800".encode("utf-8", "surrogatepass")
