"""No password of a connection setting gets into an error, a log line or a probe body."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox import redaction
from outbox.config import Settings
from outbox.errors import BrokerUnavailable
from outbox.events import JsonFormatter, TextFormatter, emit, json_line
from outbox.health import readiness
from outbox.redaction import MIN_REMEMBERED, Redactor, secrets_in

SECRET_LETTERS = "αβγδεζηθ"
# Everything a password may hold that breaks URLs, quoting or JSON.  Free text is
# masked by value only from MIN_REMEMBERED characters on (see outbox/redaction.py).
passwords = st.text(
    alphabet=SECRET_LETTERS + "%/@:'\"?#;&= \\", min_size=MIN_REMEMBERED, max_size=30
).filter(lambda p: set(p) & set(SECRET_LETTERS))
# What a password can hold and still be one word of a URL (no space, no ';').
url_passwords = st.text(alphabet=SECRET_LETTERS + "%/@:'\"?#&=\\", min_size=1, max_size=30).filter(
    lambda p: set(p) & set(SECRET_LETTERS)
)


def leaked(text: str) -> bool:
    return bool(set(text) & set(SECRET_LETTERS))


def libpq_quoted(password: str) -> str:
    return "'" + password.replace("\\", "\\\\").replace("'", "\\'") + "'"


@pytest.fixture(autouse=True)
def fresh_redactor(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test remembers its own passwords only."""
    monkeypatch.setattr(redaction, "_default", Redactor())
    yield


# -- the reproductions of issue 9, item 8 ---------------------------------------------------
@pytest.mark.parametrize(
    ("setting", "password_pieces"),
    [
        ("postgresql://u:S3cr%tPG@127.0.0.1:5432/x", ["S3cr%tPG", "S3cr", "tPG"]),
        ("amqp://sa1:S3cr/etMQ@127.0.0.1:5672/x", ["S3cr/etMQ", "S3cr", "etMQ"]),
        ("postgresql://u:S3cr@tPG@127.0.0.1:5432/x", ["S3cr@tPG", "S3cr", "tPG"]),
    ],
)
def test_redact__the_malformed_urls_of_the_issue_by_shape_alone(
    setting: str, password_pieces: list[str]
) -> None:
    masked = Redactor()(f"cannot connect to {setting}: refused")
    assert "127.0.0.1" in masked
    for piece in password_pieces:
        assert piece not in masked


@pytest.mark.parametrize(
    ("setting", "driver_says"),
    [
        # What psycopg, urllib and libpq printed for these settings before they were
        # refused up front: a piece of the password with nothing around it.
        ("postgresql://u:S3cr%tPG@127.0.0.1/x", 'invalid percent-encoded token: "S3cr%tPG"'),
        ("amqp://sa1:S3cr/etMQ@127.0.0.1:5672/x", "Port could not be cast to integer: 'S3cr'"),
        ("postgresql://u:S3cr@tPG@127.0.0.1/x", "failed to resolve host 'tPG@127.0.0.1'"),
    ],
)
def test_redact__a_remembered_setting_is_masked_where_a_driver_quotes_a_piece_of_it(
    setting: str, driver_says: str
) -> None:
    redactor = Redactor()
    redactor.remember(setting, refused=True)
    masked = redactor(driver_says)
    assert not any(piece in masked for piece in ("S3cr", "tPG", "etMQ")), masked


def test_redact__libpq_key_value_passwords_quoted_or_not() -> None:
    redactor = Redactor()
    assert redactor("host=h password=S3cr port=5") == "host=h password=*** port=5"
    assert redactor("host=h password = 'a b\\'c' port=5") == "host=h password = *** port=5"
    assert redactor("postgres://h/db?sslmode=require&password=S3cr") == (
        "postgres://h/db?sslmode=require&password=***"
    )
    assert redactor("PGPASSWORD=S3cr sslpassword=k3y") == "PGPASSWORD=*** sslpassword=***"
    assert redactor("ssl_options={'keyfile': 'k', 'password': 'S3cr'}") == (
        "ssl_options={'keyfile': 'k', 'password': '***'}"
    )


def test_redact__keeps_what_helps_and_user_equal_password_is_not_a_secret() -> None:
    redactor = Redactor()
    redactor.remember("amqp://guest:guest@localhost:5672/%2F")
    assert redactor("ACCESS_REFUSED for user 'guest'") == "ACCESS_REFUSED for user 'guest'"
    assert (
        redactor("amqp://guest:guest@localhost:5672/%2F") == "amqp://guest:***@localhost:5672/%2F"
    )
    assert redactor("batch.committed gid=obx:outbox:ab12:7 rows=1000") == (
        "batch.committed gid=obx:outbox:ab12:7 rows=1000"
    )


def test_secrets_in__every_reading_and_encoding_of_the_password() -> None:
    malformed = "postgresql://u:S3cr@tPG@127.0.0.1/x"
    assert {"S3cr@tPG", "S3cr", "S3cr%40tPG"} <= secrets_in(malformed)
    assert "tPG" in secrets_in(malformed, refused=True)
    # A valid setting's password is masked whole, never as pieces that could be words.
    valid = "postgresql://u:my/secret?word@db/app?user=me@server"
    assert "word" not in secrets_in(valid) and "secret" not in secrets_in(valid)
    assert {"p@ss/w", "p%40ss%2Fw"} <= secrets_in("amqp://u:p%40ss%2Fw@h/v")
    assert {"a b'c"} <= secrets_in("host=h password='a b\\'c'")


# -- properties: any password, any output path -----------------------------------------------
@given(url_passwords)
def test_redact__by_shape_masks_any_password_of_a_url_word(password: str) -> None:
    redactor = Redactor()  # nothing remembered: the shape alone must do
    for url in (
        f"amqp://obx:{password}@127.0.0.1:5672/%2F",
        f"postgresql://obx:{password}@db:5432/app?sslmode=require",
    ):
        masked = redactor(f"error: cannot connect to {url} (retrying)")
        assert not leaked(masked), masked
        assert "(retrying)" in masked


@given(passwords)
def test_redact__by_shape_masks_any_quoted_libpq_password(password: str) -> None:
    masked = Redactor()(f"host=db password={libpq_quoted(password)} dbname=app")
    assert not leaked(masked), masked


@given(passwords)
def test_redact__a_remembered_password_is_masked_raw_decoded_and_encoded(password: str) -> None:
    from urllib.parse import quote, unquote

    redactor = Redactor()
    url = f"amqp://obx:{quote(password, safe='')}@mq:5672/%2F"
    dsn = f"host=db password={libpq_quoted(password)}"
    redactor.remember(url, dsn)
    for text in (password, quote(password, safe=""), unquote(quote(password)), f"<{password}>"):
        assert not leaked(redactor(text)), redactor(text)


@given(passwords)
def test_every_output_path_masks_a_configured_password(password: str) -> None:
    from urllib.parse import quote

    url = f"amqp://obx:{quote(password, safe='')}@127.0.0.1:5672/%2F"
    settings = Settings(amqp_url=url, dsn=f"host=127.0.0.1 password={libpq_quoted(password)}")
    assert not leaked(repr(settings))
    said = f"pika: ACCESS_REFUSED {password!r} {password}"

    error = BrokerUnavailable(f"cannot connect to RabbitMQ {url}: {said}", f"hint {password}")
    assert not leaked(error.message + error.hint + str(error))

    record = logging.LogRecord("outbox.relay", logging.WARNING, __file__, 1, said, (), None)
    assert not leaked(TextFormatter().format(record))
    assert not leaked(JsonFormatter().format(record))
    try:
        raise RuntimeError(said)
    except RuntimeError:
        record.exc_info = sys.exc_info()
    assert not leaked(JsonFormatter().format(record))
    assert not leaked(TextFormatter().format(record))

    line = json_line(logging.ERROR, "outbox.cli", "cli.error", error=said, nested={"u": [said]})
    assert not leaked(json.loads(line)["error"]) and not leaked(line)

    body = readiness(
        started=True,
        stopping=False,
        broker_connected=False,
        last_error=said,
        database_error=f"metrics query failed: {said}",
    ).body()
    assert not leaked(body)


def test_emit__masks_fields_for_any_handler_of_the_embedding_application(
    caplog: pytest.LogCaptureFixture,
) -> None:
    redaction.remember("amqp://obx:S3cr%2FetMQ@mq/v")
    with caplog.at_level(logging.INFO, logger="outbox.test"):
        emit(logging.getLogger("outbox.test"), "relay.retry", error="login S3cr/etMQ refused")
    [record] = caplog.records
    assert "S3cr" not in record.getMessage()
    assert "S3cr" not in json.dumps(record.fields)  # type: ignore[attr-defined]
