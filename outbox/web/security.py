"""Who may use the console, and proof that a POST came from one of its own pages.

The rules (pure functions; ``app.py`` applies them to every request):

- **Bind.** The console listens on 127.0.0.1 unless told otherwise.  Any other
  address (``0.0.0.0``, a LAN address, ``::``) requires credentials from the
  environment, and ``check_bind`` refuses to start without them.  Credentials given
  for a loopback bind are required too.
- **Credentials.** ``OUTBOX_WEB_TOKEN`` (sent as ``Authorization: Bearer TOKEN``, or
  as the password of HTTP basic auth with any user name, which is what a browser
  prompts for) and/or ``OUTBOX_WEB_USER`` with ``OUTBOX_WEB_PASSWORD`` (HTTP basic
  auth).  Compared in constant time.
- **CSRF.** Every state-changing request is a POST that carries the token of the
  ``outbox_csrf_PORT`` cookie, as the form field ``csrf_token`` or the ``X-CSRF-Token``
  header (the signed double-submit cookie pattern).  The cookie value is a random
  nonce signed with a per-process key, so a cookie planted by another site on the
  same host does not verify; it is ``SameSite=Strict`` and ``HttpOnly``.  Its name
  carries the port the browser uses (cookies ignore ports): two consoles on one host
  keep a cookie each.  A POST whose
  ``Origin`` names another host is refused as well.
- **Host.** Without credentials, only a request addressed to a loopback name
  (``Host: 127.0.0.1:8310``, ``localhost``, ``[::1]``) is served.  Otherwise any web
  page could reach the console by DNS rebinding: its own name, re-pointed at
  127.0.0.1, makes the browser treat the console as that page's origin, so the page
  reads the console's pages, gets a CSRF cookie of its own and passes the
  ``Origin`` check.  A reverse proxy that forwards another name needs credentials.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import ipaddress
import secrets
from collections.abc import Mapping, Sequence

from outbox import redaction

TOKEN_ENV = "OUTBOX_WEB_TOKEN"
USER_ENV = "OUTBOX_WEB_USER"
PASSWORD_ENV = "OUTBOX_WEB_PASSWORD"
CSRF_COOKIE = "outbox_csrf"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
LOCAL = "local"  # who acted, when no credentials are configured (loopback only)


class BindRefused(ValueError):
    """A non-local bind without credentials, or half a pair of credentials."""


@dataclasses.dataclass(frozen=True)
class Credentials:
    token: str | None = None
    user: str | None = None
    password: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Credentials:
        """The credentials in ``env`` (empty values count as unset)."""
        found = cls(
            token=env.get(TOKEN_ENV) or None,
            user=env.get(USER_ENV) or None,
            password=env.get(PASSWORD_ENV) or None,
        )
        if bool(found.user) != bool(found.password):
            raise BindRefused(f"set both {USER_ENV} and {PASSWORD_ENV} for basic auth, or neither")
        if found.user and ":" in found.user:
            # Basic auth sends "user:password" and splits at the first colon (RFC 7617):
            # such a user could never log in.
            raise BindRefused(
                f"{USER_ENV} cannot contain ':' (basic auth splits user and password there)"
            )
        for secret in (found.token, found.password):
            if secret:
                redaction.remember(f"scheme://console:{secret}@console")
        return found

    def __bool__(self) -> bool:
        return bool(self.token or (self.user and self.password))


def trusted_proxies(given: Sequence[str]) -> tuple[str, ...]:
    """The ``--trusted-proxy`` values as networks uvicorn understands; refuses anything
    else (a name, or ``*``, which would let every client choose its audited address)."""
    proxies = []
    for value in given:
        try:
            proxies.append(str(ipaddress.ip_network(value.strip(), strict=False)))
        except ValueError:
            raise BindRefused(
                f"--trusted-proxy {value!r} is not an IP address or network "
                "(e.g. 10.0.0.5 or 10.0.0.0/8)"
            ) from None
    return tuple(dict.fromkeys(proxies))


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only (``localhost``, 127.0.0.0/8, ::1)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def addressed_locally(host_header: str | None) -> bool:
    """Whether a request's ``Host`` header names this machine by a loopback name."""
    if not host_header:
        return False
    host = host_header.strip()
    if host.startswith("["):
        name, bracket, _ = host[1:].partition("]")
        return bool(bracket) and is_loopback(name)
    name, _, port = host.partition(":")
    return (not port or port.isdigit()) and is_loopback(name)


def csrf_cookie(host_header: str | None) -> str:
    """The CSRF cookie's name for a console reached as ``host_header``: with its port."""
    port = (host_header or "").rpartition("]")[2].rpartition(":")[2]
    return f"{CSRF_COOKIE}_{port}" if port.isdigit() else CSRF_COOKIE


def check_bind(host: str, credentials: Credentials) -> None:
    """Refuse a bind other than loopback without credentials."""
    if not is_loopback(host) and not credentials:
        raise BindRefused(
            f"--host {host} serves other machines, so the console needs credentials: "
            f"set {TOKEN_ENV}, or {USER_ENV} and {PASSWORD_ENV}, in the environment "
            "(or bind 127.0.0.1 and reach it through an SSH tunnel)"
        )


def authenticate(authorization: str | None, credentials: Credentials) -> str | None:
    """Who sent this ``Authorization`` header, or None if it proves nothing.

    Returns the basic-auth user name, or ``"token"`` for the token.  With no
    credentials configured (a loopback bind) everyone is ``LOCAL``.
    """
    if not credentials:
        return LOCAL
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer":
        return "token" if _equal(value, credentials.token) else None
    if scheme.lower() != "basic":
        return None
    try:
        user, colon, password = base64.b64decode(value, validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    if not colon:
        return None
    if (
        credentials.user
        and _equal(user, credentials.user)
        and _equal(password, credentials.password)
    ):
        return user
    if _equal(password, credentials.token):
        return "token"  # not the user name typed with it: nothing vouches for that
    return None


def _equal(given: str, expected: str | None) -> bool:
    if not expected:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


class CsrfKeys:
    """Issues and checks this process's CSRF tokens (``nonce.signature``)."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or secrets.token_bytes(32)

    def issue(self) -> str:
        nonce = secrets.token_urlsafe(24)
        return f"{nonce}.{self._sign(nonce)}"

    def valid(self, token: str | None) -> bool:
        """Whether ``token`` was issued by this process."""
        if not token:
            return False
        nonce, dot, signature = token.partition(".")
        return bool(dot and nonce) and hmac.compare_digest(signature, self._sign(nonce))

    def request_ok(self, cookie: str | None, submitted: str | None) -> bool:
        """A POST may change state: the cookie is ours and the page sent it back."""
        if not (cookie and submitted and self.valid(cookie)):
            return False
        return hmac.compare_digest(cookie.encode(), submitted.encode())

    def _sign(self, nonce: str) -> str:
        return hmac.new(self._key, nonce.encode(), hashlib.sha256).hexdigest()[:32]


def same_origin(origin: str | None, host: str | None) -> bool:
    """An ``Origin`` header (when a browser sends one) must name this console's host.

    The scheme is not compared: behind a proxy that ends TLS the console sees http
    while the browser says https.
    """
    if not origin:
        return True  # not every client sends it; the CSRF token is the real check
    if origin == "null" or not host:
        return False
    _, sep, netloc = origin.partition("://")
    return bool(sep) and netloc.rstrip("/").lower() == host.lower()
