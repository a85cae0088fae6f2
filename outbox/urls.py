"""Check the two connection settings before any driver sees them.

``--amqp-url`` may hold several URLs separated by ``;`` (kombu's failover
convention); ``parse_amqp_urls`` checks each one and returns them in order.
``check_dsn`` checks a PostgreSQL DSN with libpq's own parser (no connection is
made), plus the values libpq only checks when connecting.

Why here and not in the drivers: on a malformed URL the drivers raise tracebacks
whose text echoes pieces of it, and a piece of the user-info part is a piece of the
password (``amqp://u:S3cr/etMQ@h`` makes urllib complain about the *port*
``S3cr``).  So the messages below never quote the user's text: they say what is
wrong and how to write it.  A user-info part that an unencoded ``@``, ``/``, ``?``
or ``#`` makes ambiguous is refused rather than guessed at.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import os
import re
from collections.abc import Mapping
from urllib.parse import parse_qs, quote, unquote

AMQP_PORTS = {"amqp": 5672, "amqps": 5671}

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
_PORT = re.compile(r"^[0-9]{1,5}$")

# pika's URL query parameters (pika.connection.URLParameters._set_url_*) and what
# each must be; pika raises a traceback for anything else.
_INT_PARAMS = {
    "channel_max": (1, 65535),
    "connection_attempts": (1, 1000),
    "frame_max": (4096, 2**31 - 1),
    "heartbeat": (0, 65535),
}
_FLOAT_PARAMS = ("blocked_connection_timeout", "retry_delay", "socket_timeout", "stack_timeout")
_LITERAL_PARAMS = ("client_properties", "ssl_options", "tcp_options")
_TEXT_PARAMS = ("locale",)

_SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
_PG_SCHEMES = ("postgresql", "postgres")
_PG_NUMBERS = ("connect_timeout", "keepalives", "keepalives_idle", "keepalives_interval")

_LIBPQ_REASONS = (
    ('missing "="', "a word without '=' (quote a value that holds spaces: dbname='my db')"),
    ("invalid connection option", "an unknown keyword (see libpq's connection parameters)"),
    ("unterminated quoted string", "a quoted value is not closed"),
    ("percent-encoded", "a '%' is not an escape; write '%' as %25"),
)

_ENCODE_HINT = "percent-encode @ / ? # % in the user name and password as %40 %2F %3F %23 %25"


class InvalidUrl(ValueError):
    """A connection setting that cannot be right; the message never quotes it."""


@dataclasses.dataclass(frozen=True)
class AmqpUrl:
    text: str  # the URL as given (it holds the password: never print it)
    scheme: str
    host: str
    port: int
    vhost: str
    username: str | None
    params: tuple[tuple[str, str], ...] = ()

    @property
    def tls(self) -> bool:
        return self.scheme == "amqps" or "ssl_options" in dict(self.params)

    def describe(self) -> str:
        """Where it points, without credentials: ``amqps://localhost:5671/%2F``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}/{quote(self.vhost, safe='')}"


def parse_amqp_urls(text: str) -> list[AmqpUrl]:
    """Every URL of a ``;``-separated list, checked; raises ``InvalidUrl``."""
    if not text.strip():
        raise InvalidUrl("it is empty: give an amqp:// or amqps:// URL")
    _check_utf8(text)
    pieces = text.split(";")
    urls = []
    for number, piece in enumerate(pieces, start=1):
        try:
            # Only the first scheme is surely not a piece of a password cut by a ';'.
            urls.append(_parse_amqp_url(piece.strip(), quote_scheme=number == 1))
        except InvalidUrl as exc:
            if len(pieces) == 1:
                raise
            raise InvalidUrl(f"URL {number} of {len(pieces)}: {exc}") from None
    return urls


def _parse_amqp_url(text: str, *, quote_scheme: bool) -> AmqpUrl:
    if not text:
        raise InvalidUrl("an empty URL in the list (a stray ';'?)")
    match = _SCHEME.match(text)
    if not match:
        raise InvalidUrl("it must start with amqp:// or amqps://")
    scheme = match.group(1).lower()
    if scheme not in AMQP_PORTS:
        what = f"the scheme {scheme!r}" if quote_scheme else "the scheme"
        raise InvalidUrl(f"{what} is not amqp or amqps")
    rest = text[match.end() :]
    userinfo, hostport, path, query = _split_authority(rest)
    username = None
    if userinfo is not None:
        if ":" not in userinfo:
            raise InvalidUrl("a user name without a password (RabbitMQ needs both)")
        if _BAD_ESCAPE.search(userinfo):
            raise InvalidUrl(f"a '%' in the user or password is not an escape; {_ENCODE_HINT}")
        username = unquote(userinfo.split(":", 1)[0])
    host, port = _host_port(hostport, AMQP_PORTS[scheme])
    return AmqpUrl(
        text=text,
        scheme=scheme,
        host=host,
        port=port,
        vhost=_vhost(path),
        username=username,
        params=_amqp_params(query),
    )


def _split_authority(
    rest: str, *, query_may_hold_at: bool = False
) -> tuple[str | None, str, str, str]:
    """(user-info or None, host[:port], path, query) of what follows ``scheme://``.

    An '@' after the host means a raw '/', '?' or '#' cut the password short, and
    the rest of it would be read as a path or a query.  libpq's query may hold an
    '@' (``?user=me@server``), and libpq itself reads ``u:pa?ss@h`` as the password
    ``pa?ss``.
    """
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    if "@" in (tail.partition("?")[0] if query_may_hold_at else tail):
        raise InvalidUrl(
            f"the user or password seems to hold an unencoded '/', '?' or '#'; {_ENCODE_HINT}"
        )
    if authority.count("@") > 1:
        raise InvalidUrl(f"the user or password holds an unencoded '@'; {_ENCODE_HINT}")
    if "#" in tail:
        raise InvalidUrl("a URL fragment ('#…') means nothing here; write '#' as %23")
    userinfo, _, hostport = authority.rpartition("@")
    path, _, query = tail.partition("?")
    return (userinfo if "@" in authority else None), hostport, path, query


def _host_port(hostport: str, default_port: int) -> tuple[str, int]:
    if hostport.startswith("["):  # [IPv6]:port
        host, bracket, port_text = hostport[1:].partition("]")
        if not bracket or (port_text and not port_text.startswith(":")):
            raise InvalidUrl("an IPv6 host must be written [address] or [address]:port")
        port_text = port_text[1:]
    else:
        host, _, port_text = hostport.partition(":")
    if not host:
        raise InvalidUrl("it names no host")
    if port_text == "" and hostport.endswith(":"):
        raise InvalidUrl("the port after ':' is missing")
    if not port_text:
        return host, default_port
    if not _PORT.match(port_text) or not 1 <= int(port_text) <= 65535:
        raise InvalidUrl("the port is not a number from 1 to 65535")
    return host, int(port_text)


def _vhost(path: str) -> str:
    if path in ("", "/"):
        return "/"
    segment = path[1:]
    if "/" in segment:
        raise InvalidUrl("the virtual host must be one path segment; write '/' in it as %2F")
    if _BAD_ESCAPE.search(segment):
        raise InvalidUrl("a '%' in the virtual host is not an escape; write '%' as %25")
    return unquote(segment)


def _amqp_params(query: str) -> tuple[tuple[str, str], ...]:
    if not query:
        return ()
    try:
        parsed = parse_qs(query, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        raise InvalidUrl("the query string is not name=value pairs joined by '&'") from None
    params = []
    for name, values in parsed.items():
        if len(values) != 1:
            raise InvalidUrl("a query parameter is given more than once")
        value = values[0]
        _check_param(name, value)
        params.append((name, value))
    return tuple(params)


def _check_param(name: str, value: str) -> None:
    if name in _INT_PARAMS:
        low, high = _INT_PARAMS[name]
        if not re.fullmatch(r"[0-9]+", value) or not low <= int(value) <= high:
            raise InvalidUrl(f"the parameter {name} must be a whole number from {low} to {high}")
    elif name in _FLOAT_PARAMS:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number <= 0:
            raise InvalidUrl(f"the parameter {name} must be a number of seconds above 0")
    elif name in _LITERAL_PARAMS:
        try:
            literal = ast.literal_eval(value)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            literal = ...
        if not isinstance(literal, dict) and not (name == "ssl_options" and literal is None):
            # The value is not quoted back: ssl_options may hold a key's password.
            raise InvalidUrl(f"the parameter {name} must be a Python dict literal")
    elif name not in _TEXT_PARAMS:
        known = ", ".join(sorted([*_INT_PARAMS, *_FLOAT_PARAMS, *_LITERAL_PARAMS, *_TEXT_PARAMS]))
        # The name is not quoted back: a ';' inside a password can leave a piece
        # of it in a query.
        raise InvalidUrl(f"an unknown query parameter (pika knows: {known})")


def check_dsn(dsn: str) -> dict[str, str]:
    """The DSN's settings as libpq reads them; raises ``InvalidUrl``.

    An empty DSN is valid: libpq then takes everything from ``PG*`` variables.
    """
    _check_utf8(dsn)
    match = _SCHEME.match(dsn)
    if match:
        if match.group(1).lower() not in _PG_SCHEMES:
            raise InvalidUrl(
                f"the scheme {match.group(1).lower()!r} is not postgresql: give "
                "a postgresql:// URL or key=value pairs"
            )
        _split_authority(dsn[match.end() :], query_may_hold_at=True)
        if _BAD_ESCAPE.search(dsn):
            raise InvalidUrl(f"a '%' in the URL is not an escape; {_ENCODE_HINT}")
    # libpq's own parser: the truth about what a DSN means.  It makes no connection.
    from psycopg import ProgrammingError
    from psycopg.conninfo import conninfo_to_dict

    try:
        settings = {k: str(v) for k, v in conninfo_to_dict(dsn).items()}
    except ProgrammingError as exc:
        raise InvalidUrl(f"libpq cannot read it: {_libpq_reason(exc)}") from None
    for port in settings.get("port", "").split(","):
        if port and (not _PORT.match(port) or not 1 <= int(port) <= 65535):
            raise InvalidUrl("the port is not a number from 1 to 65535")
    for name in _PG_NUMBERS:
        if name in settings and not re.fullmatch(r"-?[0-9]+", settings[name].strip()):
            raise InvalidUrl(f"{name} must be a whole number")
    if "sslmode" in settings and settings["sslmode"] not in _SSLMODES:
        raise InvalidUrl(f"sslmode must be one of {', '.join(_SSLMODES)}")
    return settings


def dsn_database(settings: Mapping[str, str]) -> str:
    """The database a DSN's ``check_dsn`` settings name, as libpq picks it (dbname,
    else the user name)."""
    return (
        settings.get("dbname")
        or os.environ.get("PGDATABASE")
        or settings.get("user")
        or os.environ.get("PGUSER")
        or "postgres"
    )


def _check_utf8(setting: str) -> None:
    """Bytes that are not UTF-8 (an environment variable or argument written in
    another encoding) reach Python as surrogates (PEP 383), which neither psycopg nor
    pika can encode: both would raise a traceback."""
    try:
        setting.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidUrl(
            "it holds bytes that are not UTF-8 (written in another encoding?): write it in UTF-8"
        ) from None


def _libpq_reason(exc: Exception) -> str:
    """What libpq objects to, in our words: its own message quotes pieces of the DSN."""
    text = str(exc)
    for pattern, reason in _LIBPQ_REASONS:
        if pattern in text:
            return reason
    return "check the key=value syntax and the quoting of values"
