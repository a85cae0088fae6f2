"""Who may use the console, and proof that a POST came from one of its own pages.

The rules (pure functions; ``site.py`` applies them to every request):

- **Bind.** The console listens on 127.0.0.1 unless told otherwise.  Any other
  address (``0.0.0.0``, a LAN address, ``::``) requires credentials from the
  environment, and ``check_bind`` refuses to start without them.  Credentials given
  for a loopback bind are required too.
- **Credentials.** ``OUTBOX_WEB_TOKEN`` (sent as ``Authorization: Bearer TOKEN``, or
  as the password of HTTP basic auth with any user name, which is what a browser
  prompts for) and/or ``OUTBOX_WEB_USER`` with ``OUTBOX_WEB_PASSWORD`` (HTTP basic
  auth).  Compared in constant time.  For a bind other machines reach, each secret
  must be at least 16 characters and hard to guess (``weak``).  Failed attempts are
  throttled per client and in total (``Throttle``: 10, then one a second).
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
import math
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence

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


# A secret guarding a console other machines reach: at least this long, and this
# strong by the estimate of ``strength_bits`` (what 16 random letters and digits
# give; a token of ``secrets.token_urlsafe(24)`` has 192 bits).
MIN_SECRET_CHARS = 16
MIN_SECRET_BITS = 80
GENERATE = "python3 -c 'import secrets; print(secrets.token_urlsafe(24))'"


def strength_bits(secret: str) -> float:
    """A generous estimate of a secret's entropy in bits: its length times the bits of
    the character classes it uses, counting only its distinct characters past the
    first repeat of each (``aaaa…`` and ``abcabc…`` are weak whatever their length)."""
    classes = 0
    if any(c.islower() for c in secret):
        classes += 26
    if any(c.isupper() for c in secret):
        classes += 26
    if any(c.isdigit() for c in secret):
        classes += 10
    if any(not c.isalnum() for c in secret):
        classes += 33
    distinct = len(set(secret))
    # Each character adds its class's bits, but no more characters count than twice
    # the number of distinct ones: a short pattern repeated adds little.
    counted = min(len(secret), 2 * distinct)
    return counted * math.log2(classes) if classes else 0.0


def weak(secret: str) -> str | None:
    """Why ``secret`` is too weak for a console other machines reach, or None."""
    if len(secret.strip()) < MIN_SECRET_CHARS:
        return f"shorter than {MIN_SECRET_CHARS} characters"
    if strength_bits(secret) < MIN_SECRET_BITS:
        return "too predictable (too few different characters)"
    return None


def check_bind(host: str, credentials: Credentials) -> None:
    """Refuse a bind other than loopback without credentials, or with weak ones."""
    if is_loopback(host):
        return
    if not credentials:
        raise BindRefused(
            f"--host {host} serves other machines, so the console needs credentials: "
            f"set {TOKEN_ENV}, or {USER_ENV} and {PASSWORD_ENV}, in the environment "
            f"(or bind 127.0.0.1 and reach it through an SSH tunnel); generate a token "
            f"with {GENERATE}"
        )
    for name, secret in ((TOKEN_ENV, credentials.token), (PASSWORD_ENV, credentials.password)):
        why = weak(secret) if secret else None
        if why:
            raise BindRefused(
                f"{name} is {why}: --host {host} serves other machines, so it must be at "
                f"least {MIN_SECRET_CHARS} characters and hard to guess; generate one "
                f"with {GENERATE}"
            )


class Throttle:
    """Slows guessing: each client (and all of them together) may fail to
    authenticate ``burst`` times, then once per ``every`` seconds.

    A client over its allowance is refused (429) without its credentials being
    looked at, so a guess made then tells nothing, right or wrong.  The state is a
    token bucket per client address, in memory, forgotten once it is full again.
    """

    def __init__(
        self,
        *,
        burst: int = 10,
        every: float = 1.0,
        clients_burst: int = 100,
        clients_every: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        most_clients: int = 10_000,
    ) -> None:
        self._rules = {"client": (burst, every), "all": (clients_burst, clients_every)}
        self._clock = clock
        self._most = most_clients
        self._buckets: dict[str, tuple[float, float]] = {}  # key: (tokens, at)
        self._lock = threading.Lock()

    def _level(self, key: str, rule: str, now: float) -> float:
        burst, every = self._rules[rule]
        tokens, at = self._buckets.get(key, (float(burst), now))
        return min(float(burst), tokens + (now - at) / every)

    def allowed(self, client: str) -> bool:
        """Whether ``client`` may try to authenticate now."""
        now = self._clock()
        with self._lock:
            return all(
                self._level(key, rule, now) >= 1.0
                for key, rule in ((f"c:{client}", "client"), ("all", "all"))
            )

    def failed(self, client: str) -> None:
        """``client`` sent credentials that proved nothing."""
        now = self._clock()
        with self._lock:
            for key, rule in ((f"c:{client}", "client"), ("all", "all")):
                self._buckets[key] = (max(0.0, self._level(key, rule, now) - 1.0), now)
            if len(self._buckets) > self._most:
                full = [
                    k
                    for k in self._buckets
                    if self._level(k, _rule(k), now) >= self._rules[_rule(k)][0]
                ]
                for key in full or list(self._buckets)[: len(self._buckets) // 2]:
                    del self._buckets[key]

    def retry_after(self, client: str) -> int:
        """Seconds until ``client`` may try again (at least 1)."""
        now = self._clock()
        with self._lock:
            waits = [
                (1.0 - self._level(key, rule, now)) * self._rules[rule][1]
                for key, rule in ((f"c:{client}", "client"), ("all", "all"))
            ]
        return max(1, math.ceil(max(waits)))


def _rule(key: str) -> str:
    return "all" if key == "all" else "client"


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
