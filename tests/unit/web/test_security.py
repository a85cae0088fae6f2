"""The console's access rules: binds, credentials, CSRF tokens, Origin (pure)."""

from __future__ import annotations

import base64
import secrets

import pytest

from outbox.redaction import redact
from outbox.web import security
from outbox.web.security import BindRefused, Credentials, CsrfKeys


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_check_bind__loopback_needs_no_credentials(host: str) -> None:
    security.check_bind(host, Credentials())


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "console.example.com"])
def test_check_bind__any_other_address_refuses_to_start_without_credentials(host: str) -> None:
    with pytest.raises(BindRefused, match="OUTBOX_WEB_TOKEN"):
        security.check_bind(host, Credentials())
    security.check_bind(host, Credentials(token="Kq3-vT9xZ2pLm8Rw4bN7"))
    security.check_bind(host, Credentials(user="ops", password="h7Gx-2kPq9Lz4Vw8mRt3"))


def test_credentials__half_a_basic_auth_pair_is_refused() -> None:
    with pytest.raises(BindRefused, match="both"):
        Credentials.from_env({"OUTBOX_WEB_USER": "ops"})
    assert not Credentials.from_env({"OUTBOX_WEB_TOKEN": ""})


def test_credentials__a_basic_auth_user_with_a_colon_is_refused() -> None:
    """Basic auth splits "user:password" at the first colon: such a user could never
    log in, so the console refuses to start with it."""
    with pytest.raises(BindRefused, match="cannot contain ':'"):
        Credentials.from_env({"OUTBOX_WEB_USER": "ops:team", "OUTBOX_WEB_PASSWORD": "pw-value"})


def test_trusted_proxies__addresses_and_networks_only() -> None:
    assert security.trusted_proxies(["10.0.0.5", " 10.0.0.0/8", "::1", "10.0.0.5"]) == (
        "10.0.0.5/32",
        "10.0.0.0/8",
        "::1/128",
    )
    for bad in ("*", "proxy.example.com", "10.0.0.0/33", ""):
        with pytest.raises(BindRefused, match="--trusted-proxy"):
            security.trusted_proxies([bad])


def test_credentials__their_secrets_are_masked_in_everything_printed() -> None:
    Credentials.from_env(
        {
            "OUTBOX_WEB_TOKEN": "Tok3n-Secr3t",
            "OUTBOX_WEB_USER": "ops",
            "OUTBOX_WEB_PASSWORD": "Pa55-w0rd-x",
        }
    )
    assert "Tok3n-Secr3t" not in redact("token Tok3n-Secr3t given")
    assert "Pa55-w0rd-x" not in redact("password Pa55-w0rd-x given")


def test_authenticate__no_credentials_configured_means_local() -> None:
    assert security.authenticate(None, Credentials()) == security.LOCAL


def test_authenticate__token_as_bearer_or_as_basic_password() -> None:
    creds = Credentials(token="s3cret-token")
    assert security.authenticate("Bearer s3cret-token", creds) == "token"
    assert security.authenticate(basic("alice", "s3cret-token"), creds) == "token"
    assert security.authenticate("Bearer wrong", creds) is None
    assert security.authenticate(basic("alice", "wrong"), creds) is None
    assert security.authenticate(None, creds) is None


def test_authenticate__basic_user_and_password_name_who_acted() -> None:
    creds = Credentials(user="ops", password="pw-value")
    assert security.authenticate(basic("ops", "pw-value"), creds) == "ops"
    assert security.authenticate(basic("ops", "other"), creds) is None
    assert security.authenticate(basic("eve", "pw-value"), creds) is None
    assert security.authenticate("Basic not-base64!", creds) is None
    assert security.authenticate("Basic " + base64.b64encode(b"no-colon").decode(), creds) is None
    assert security.authenticate("Digest x", creds) is None


def test_csrf__only_a_token_this_process_issued_and_the_page_sent_back_passes() -> None:
    keys = CsrfKeys()
    token = keys.issue()
    assert keys.valid(token)
    assert keys.request_ok(token, token)
    assert not keys.request_ok(token, None)  # no token in the form
    assert not keys.request_ok(None, token)  # no cookie
    assert not keys.request_ok(token, keys.issue())  # another page's token
    forged = token.split(".")[0] + "." + "0" * 32
    assert not keys.request_ok(forged, forged)  # a cookie planted by someone else
    assert not CsrfKeys().valid(token)  # another process (a restart) issued it


def test_same_origin__a_foreign_origin_is_refused_a_missing_one_is_left_to_the_token() -> None:
    assert security.same_origin(None, "127.0.0.1:8310")
    assert security.same_origin("http://127.0.0.1:8310", "127.0.0.1:8310")
    assert security.same_origin("https://console.example", "console.example")  # behind TLS
    assert not security.same_origin("http://evil.example", "127.0.0.1:8310")
    assert not security.same_origin("http://127.0.0.1:9999", "127.0.0.1:8310")
    assert not security.same_origin("null", "127.0.0.1:8310")
    assert not security.same_origin("garbage", "127.0.0.1:8310")


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1:8310", "127.0.0.1", "localhost:8310", "LOCALHOST", "[::1]:8310", "[::1]"],
)
def test_addressed_locally__loopback_names_with_or_without_a_port(host: str) -> None:
    assert security.addressed_locally(host)


@pytest.mark.parametrize(
    "host",
    [
        None,
        "",
        "evil.example:8310",
        "evil.example",
        "127.0.0.1.evil.example:8310",
        "localhost.evil.example",
        "[::1",
        "127.0.0.1:x",
        "10.0.0.5:8310",
        "[::2]:8310",
    ],
)
def test_addressed_locally__any_other_name_is_not(host: str | None) -> None:
    # DNS rebinding: a page of evil.example, its name re-pointed at 127.0.0.1,
    # reaches the console with its own name in Host.
    assert not security.addressed_locally(host)


@pytest.mark.parametrize(
    "secret",
    [" ", "x", "t0ken-value", "a" * 40, "abcabcabcabcabcabcabc", "passwordpassword"],
)
def test_check_bind__a_weak_secret_is_refused_for_a_bind_other_machines_reach(
    secret: str,
) -> None:
    """Any non-empty token was accepted for a public bind (' ', one character)."""
    for credentials in (Credentials(token=secret), Credentials(user="ops", password=secret)):
        with pytest.raises(BindRefused, match=r"secrets\.token_urlsafe"):
            security.check_bind("0.0.0.0", credentials)
        security.check_bind("127.0.0.1", credentials)  # this machine only: as it was
    security.check_bind("0.0.0.0", Credentials(token=secrets.token_urlsafe(24)))


def test_throttle__ten_failures_then_one_a_second_per_client_and_for_all() -> None:
    now = [1000.0]
    throttle = security.Throttle(clock=lambda: now[0], clients_burst=25, clients_every=0.5)
    for _ in range(10):
        assert throttle.allowed("10.0.0.1")
        throttle.failed("10.0.0.1")
    assert not throttle.allowed("10.0.0.1") and throttle.retry_after("10.0.0.1") == 1
    assert throttle.allowed("10.0.0.2")  # another client
    now[0] += 1.0
    assert throttle.allowed("10.0.0.1")
    throttle.failed("10.0.0.1")
    assert not throttle.allowed("10.0.0.1")
    # Many clients at once: all of them together are slowed too.
    for n in range(16):
        throttle.failed(f"10.1.0.{n}")
    assert not throttle.allowed("10.2.0.1")
    now[0] += 0.5
    assert throttle.allowed("10.2.0.1")
