"""Connection settings are checked before any driver sees them (``outbox.urls``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox.urls import InvalidUrl, check_dsn, parse_amqp_urls

# Letters no message of ours contains: if one shows up, a password leaked.
SECRET_LETTERS = "αβγδεζηθ"
passwords = st.text(alphabet=SECRET_LETTERS + "%/@:'\"?#;&= \\", min_size=1, max_size=30)


def test_parse_amqp_urls__reads_host_port_vhost_and_tls() -> None:
    [url] = parse_amqp_urls("amqp://guest:guest@127.0.0.1:5672/%2F")
    assert (url.scheme, url.host, url.port, url.vhost, url.username) == (
        "amqp",
        "127.0.0.1",
        5672,
        "/",
        "guest",
    )
    assert not url.tls
    [tls] = parse_amqp_urls("amqps://u:p%40ss@mq.example.com/prod?heartbeat=30")
    assert (tls.port, tls.vhost, tls.tls, tls.params) == (
        5671,
        "prod",
        True,
        (("heartbeat", "30"),),
    )
    assert tls.describe() == "amqps://mq.example.com:5671/prod"
    [v6] = parse_amqp_urls("amqp://u:p@[::1]:5673")
    assert (v6.host, v6.port, v6.vhost, v6.describe()) == (
        "::1",
        5673,
        "/",
        "amqp://[::1]:5673/%2F",
    )


def test_parse_amqp_urls__a_semicolon_list_is_several_brokers_in_order() -> None:
    urls = parse_amqp_urls("amqp://u:p@mq1:5672/v; amqps://u:p@mq2/v")
    assert [(u.host, u.port, u.scheme) for u in urls] == [
        ("mq1", 5672, "amqp"),
        ("mq2", 5671, "amqps"),
    ]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("ftp://u:p@h/v", "'ftp' is not amqp or amqps"),
        ("http://guest:guest@localhost/", "'http' is not amqp or amqps"),
        ("127.0.0.1:5672", "must start with amqp:// or amqps://"),
        ("amqp://u:p@h:abc/v", "port is not a number"),
        ("amqp://u:p@h:0/v", "port is not a number"),
        ("amqp://u:p@h:70000/v", "port is not a number"),
        ("amqp://u:p@h:/v", "port after ':' is missing"),
        ("amqp://guest:guest@127.0.0.1:5672/%2F?heartbeat=abc", "heartbeat must be a whole"),
        ("amqp://u:p@h/v?heartbeat=-1", "heartbeat must be a whole"),
        ("amqp://u:p@h/v?socket_timeout=nan", "socket_timeout must be a number"),
        ("amqp://u:p@h/v?frame_max=10", "frame_max must be a whole number from 4096"),
        ("amqp://u:p@h/v?ssl_options=abc", "ssl_options must be a Python dict"),
        ("amqp://u:p@h/v?colour=blue", "unknown query parameter (pika knows: "),
        ("amqp://u:p@h/v?heartbeat=1&heartbeat=2", "given more than once"),
        ("amqp://u:p@h/a/b", "one path segment"),
        ("amqp://guest@localhost/", "without a password"),
        ("amqp://u:p@/v", "names no host"),
        ("amqp://sa1:S3cr/etMQ@127.0.0.1:5672/x", "unencoded '/', '?' or '#'"),
        ("amqp://u:S3cr@tXQ@127.0.0.1:5672/x", "unencoded '@'"),
        ("amqp://u:S3cr%tXQ@127.0.0.1:5672/x", "'%' in the user or password is not an escape"),
        ("amqp://u:p@h/v#frag", "fragment"),
        ("amqp://u:p@h/v;", "URL 2 of 2: an empty URL"),
        ("amqp://u:p@h/v;127.0.0.1", "URL 2 of 2: it must start with amqp://"),
        ("amqp://u:p@h/v;ab://x@h", "URL 2 of 2: the scheme is not amqp or amqps"),
        # A Latin-1 byte from the environment (PEP 383), where pika would traceback.
        ("amqp://u:S3cr\udce9tXQ@127.0.0.1:5672/x", "bytes that are not UTF-8"),
    ],
)
def test_parse_amqp_urls__refuses_what_pika_would_traceback_on_or_misread(
    url: str, says: str
) -> None:
    with pytest.raises(InvalidUrl) as refused:
        parse_amqp_urls(url)
    assert says in str(refused.value)
    for fragment in ("S3cr", "etMQ", "tXQ"):
        assert fragment not in str(refused.value)


@pytest.mark.parametrize(
    "dsn",
    [
        "",
        "postgresql://localhost/postgres",
        "postgres://u:S3cr%40tPG@db.example.com:5433/app?sslmode=verify-full&sslrootcert=/ca.pem",
        "host=127.0.0.1 port=5432 dbname=app user=u password='a b\\'c'",
        "host=a,b port=5432,5433 target_session_attrs=read-write",
        "postgresql://u@[::1]:5432/app",
    ],
)
def test_check_dsn__accepts_what_libpq_accepts(dsn: str) -> None:
    check_dsn(dsn)


@pytest.mark.parametrize(
    ("dsn", "says"),
    [
        ("host=127.0.0.1 password=x port", "a word without '='"),
        ("host=127.0.0.1 password=S3cr etPG", "a word without '='"),
        ("host=127.0.0.1 colour=blue", "an unknown keyword"),
        ("host=127.0.0.1 password='S3cr", "not closed"),
        ("postgresql://u:S3cr%tPG@127.0.0.1/x", "'%' in the URL is not an escape"),
        ("postgresql://u:S3cr@tPG@127.0.0.1/x", "unencoded '@'"),
        ("postgresql://u:S3cr/tPG@127.0.0.1/x", "unencoded '/', '?' or '#'"),
        ("host=127.0.0.1 port=abc", "port is not a number"),
        ("postgresql://127.0.0.1:99999/x", "port is not a number"),
        ("host=h sslmode=verify", "sslmode must be one of"),
        ("host=h connect_timeout=soon", "connect_timeout must be a whole number"),
        ("http://u:S3cr@h/x", "'http' is not postgresql"),
        ("amqp://u:S3cr@h/x", "'amqp' is not postgresql"),
        ("host=127.0.0.1 password=S3cr\udce9tPG", "bytes that are not UTF-8"),
    ],
)
def test_check_dsn__refuses_without_quoting_the_dsn(dsn: str, says: str) -> None:
    with pytest.raises(InvalidUrl) as refused:
        check_dsn(dsn)
    assert says in str(refused.value)
    for fragment in ("S3cr", "tPG", "etPG"):
        assert fragment not in str(refused.value)


@given(passwords)
def test_parse_amqp_urls__no_error_quotes_any_piece_of_the_password(password: str) -> None:
    for url in (
        f"amqp://obx:{password}@127.0.0.1:5672/%2F",
        f"amqps://obx:{password}@mq/v;amqp://obx:{password}@mq2/v",
    ):
        try:
            parse_amqp_urls(url)
        except InvalidUrl as exc:
            assert not set(str(exc)) & set(SECRET_LETTERS), str(exc)


@given(passwords)
def test_check_dsn__no_error_quotes_any_piece_of_the_password(password: str) -> None:
    for dsn in (
        f"postgresql://obx:{password}@127.0.0.1:5432/app",
        f"host=127.0.0.1 password={password} dbname=app",
        f"host=127.0.0.1 password='{password}' dbname=app",
    ):
        try:
            check_dsn(dsn)
        except InvalidUrl as exc:
            assert not set(str(exc)) & set(SECRET_LETTERS), str(exc)
