"""No password of a connection setting gets into an error, a log line or a probe body."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from unittest import mock
from urllib.parse import quote

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from outbox import redaction
from outbox.config import Settings
from outbox.errors import BrokerUnavailable
from outbox.events import JsonFormatter, TextFormatter, emit, json_line
from outbox.health import readiness
from outbox.redaction import MASK, MIN_REMEMBERED, Redactor, secrets_in

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
    # A password shorter than MIN_REMEMBERED is masked by its shape only: by value,
    # "re" would cut "refused" apart in every message.
    redactor.remember("amqp://obx:re@localhost:5672/%2F")
    assert redactor("ACCESS_REFUSED - Login was refused") == "ACCESS_REFUSED - Login was refused"
    assert redactor("amqp://obx:re@localhost/%2F") == "amqp://obx:***@localhost/%2F"


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


def renderings(password: str) -> dict[str, str]:
    """How a driver, an exception or a log may print a password (worked out here, apart
    from outbox/redaction.py, so that a form it forgets shows up)."""
    utf8 = password.encode("utf-8", "surrogateescape")
    return {
        "as written": password,
        "percent-encoded": quote(utf8, safe=""),
        "percent-encoded, '/' kept": quote(utf8),
        "repr": repr(password)[1:-1],
        # repr() escapes ' only in a text that also holds a '"'.
        "repr, in a text with both quotes": repr("'\"" + password)[4:-1],
        "JSON": json.dumps(password)[1:-1],
        "JSON, not ASCII": json.dumps(password, ensure_ascii=False)[1:-1],
        "UTF-8 bytes repr": repr(utf8)[2:-1],
        "UTF-8 bytes repr, in bytes with both quotes": repr(b"'\"" + utf8)[5:-1],
        # An exception's repr of a message that already quoted it with repr().
        "repr of repr": repr(repr(password)[1:-1])[1:-1],
        "JSON of repr": json.dumps(repr(password)[1:-1])[1:-1],
    }


def libpq_setting(password: str) -> str:
    return f"host=127.0.0.1 password={libpq_quoted(password)}"


def amqp_setting(password: str) -> str:
    return f"amqp://obx:{quote(password, safe='')}@127.0.0.1:5672/%2F"


# What a password may hold in a DSN, NUL included (not in a quoted libpq value, but a
# driver may quote any text).
any_passwords = st.text(
    alphabet=SECRET_LETTERS + "%/@:'\"?#;&= \\\x00", min_size=MIN_REMEMBERED, max_size=30
).filter(lambda p: set(p) & set(SECRET_LETTERS))


@given(any_passwords)
@example("β:\N{GREEK SMALL LETTER ALPHA}")  # seen failing on main
@example("β@θ/%")
@example("β'θ")  # repr() escapes the quote only in a text that also holds a '"'
@example('β"θ\\')  # JSON escapes the quote and the backslash and keeps the letters
@example("β\x00θ")  # NUL: \x00 in repr, \u0000 in JSON
@example("β θ")
def test_redact__a_remembered_password_in_every_form_it_is_printed(password: str) -> None:
    redactor = Redactor()
    redactor.remember(libpq_setting(password), amqp_setting(password))
    for form, text in renderings(password).items():
        assert redactor(f"<{text}>") == f"<{MASK}>", (form, text, redactor(f"<{text}>"))


pieces = st.text(alphabet=SECRET_LETTERS + ":' \\%", min_size=1, max_size=8)


@given(pieces, pieces, pieces)
# Seen on main: two passwords remembered (" 'β" from an earlier example, then the
# example's own), a message quoting the second; masking the first cut the second, and
# its ':' and last letter were left.
@example(x=" '", y="β", z=":\N{GREEK SMALL LETTER ALPHA}")
@example(x="δδ '", y="β", z=":θ")
@example(x="θβ", y="θ", z="βθ")  # one password, twice, overlapping itself: θβθ in θβθβθ
def test_redact__passwords_that_overlap_in_a_text_leave_no_piece(x: str, y: str, z: str) -> None:
    first, second = x + y, y + z
    assume(len(first) >= MIN_REMEMBERED and len(second) >= MIN_REMEMBERED)
    redactor = Redactor()
    redactor.remember(libpq_setting(first), amqp_setting(second))
    both = x + y + z
    for text in (both, f"ACCESS_REFUSED {both!r} {both}", json.dumps(both), repr(both + '"')):
        assert not leaked(redactor(text)), (text, redactor(text))


def test_remember__a_password_with_undecodable_bytes_is_masked_not_a_crash() -> None:
    # An environment variable in another encoding than UTF-8 reaches Python with its
    # bytes as surrogates (PEP 383): b"\xffβ" is "\udcffβ".
    password = "ab\udcffβδ"
    redactor = Redactor()
    redactor.remember(libpq_setting(password), f"amqp://obx:{password}@127.0.0.1/%2F")
    for form, text in renderings(password).items():
        assert redactor(f"<{text}>") == f"<{MASK}>", (form, text, redactor(f"<{text}>"))


@given(passwords)
@example("β:\N{GREEK SMALL LETTER ALPHA}")  # seen failing on main
@example("β@θ/%")
@example("β'θ\"")
@example("β θ\\")
def test_every_output_path_masks_a_configured_password(password: str) -> None:
    # A fresh redactor for each example: what one remembered must not decide another's
    # outcome (overlapping passwords have a test of their own, above).
    with mock.patch.object(redaction, "_default", Redactor()):
        every_output_path_masks(password)


def every_output_path_masks(password: str) -> None:
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
