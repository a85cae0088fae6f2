"""Keep passwords out of everything the relay prints: errors, logs, status, probes.

``redact(text)`` is applied where text leaves the process: ``OutboxError``
messages and hints, ``events.emit`` and both log formatters, the CLI's error
lines, tracebacks and the health endpoints' bodies.  It masks two ways:

- by shape, in any text: the password of ``scheme://user:password@host`` (up to
  the *last* ``@`` of the word, so ``u:S3cr@tPG@host`` and ``u:S3cr/etMQ@host``
  are masked whole) and the value of libpq's ``password=…`` (quoted or not, also
  ``sslpassword`` and the like);
- by value: every password of the connection settings this process was given
  (``remember``, called by ``Settings`` and the CLI's option types, which also
  remember the pieces of a setting they refuse) is masked
  wherever it shows up, in every form ``_renderings`` lists: as written,
  percent-decoded or -encoded, as UTF-8 bytes (``b'\\xce\\xb2'``), escaped by
  ``repr`` (with either quote) or JSON (ASCII or not), and escaped twice (an
  exception's ``repr`` of a message that already quoted it).  Drivers quote a
  password without its URL around it (``invalid percent-encoded token:
  "S3cr%tPG"``); only the value says it is one.

Every match, by value and by shape, is found in the text as it came, and each run of
overlapping or adjacent matches becomes one mask.  Replacing one password after
another would not do: two passwords that overlap in a text (``x 'k3y`` and ``k3y:pw``
in ``x 'k3y:pw'``), or one that overlaps itself (``abab`` in ``ababab``), lose their
shared characters to the first replacement, and the rest of the second is printed.

Passwords shorter than ``MIN_REMEMBERED`` characters are masked by shape only:
masking every "a" or "ab" by value would cut the words of every message apart
(``Login w***s refused``), and a password that short falls to a guess anyway.
Their longer forms (``%CE%B2``, ``\\u03b2``) are still masked.  A password equal to
its user name is not secret from anyone who reads the user name.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable, Iterator
from urllib.parse import quote, unquote, unquote_to_bytes

MASK = "***"
MIN_REMEMBERED = 3

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
# scheme://user:password@ — the password runs to the last '@' of the word.
_URL_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s:@;]*:(?P<secret>[^\s;]*)@")
_KEY = r"(?i:\b(?:\w*password|\w*secret|scram_\w+_key))"
# libpq key=value (and URL query) form; a quoted value may hold escaped quotes.
_KV_PASSWORD = re.compile(_KEY + r"\s*=\s*(?P<secret>'(?:[^'\\]|\\.)*(?:'|$)|\S+)")
# Python/JSON dict form, e.g. pika's ssl_options={'password': '…'}.
_DICT_PASSWORD = re.compile(
    r"""['"]""" + _KEY + r"""['"]\s*:\s*(?P<q>['"])(?P<secret>(?:\\.|(?!(?P=q)).)*)"""
)


def secrets_in(setting: str, *, refused: bool = False) -> set[str]:
    """Every string a DSN or (list of) AMQP URL(s) may hold as a password.

    Over-generous on purpose: for ``u:S3cr@tPG@h`` both libpq's reading
    (``S3cr``) and ours (``S3cr@tPG``) count.  For a ``refused`` setting, the
    pieces between its raw '@', '/', '?' and '#' count too.
    """
    found: set[str] = set()
    for piece in {setting, *setting.split(";")}:
        match = _SCHEME.search(piece)
        if match:
            rest = piece[match.end() :]
            for at in (i for i, c in enumerate(rest) if c == "@"):
                user, colon, password = rest[:at].partition(":")
                if colon and password and password != user:
                    found.add(password)
                    if refused:
                        # Drivers quote pieces of such a password (urllib reads
                        # ``u:S3cr/etMQ@h`` as host ``u``, port ``S3cr``).  Only for a
                        # refused setting: the process ends, so masking short pieces
                        # everywhere cannot spoil a running relay's logs.
                        found.update(re.split(r"[@/?#]", password))
    for match in re.finditer(_KEY + r"\s*=\s*('(?:[^'\\]|\\.)*'|[^\s&]+)", setting):
        value = match.group(1)
        if value.startswith("'"):
            found.add(value[1:-1])
            value = re.sub(r"\\(.)", r"\1", value[1:-1])
        found.add(value)
    return {form for secret in found for form in _renderings(secret) if len(form) >= MIN_REMEMBERED}


def _renderings(secret: str) -> set[str]:
    """``secret`` as a driver, an exception or a log line may print it."""
    texts = {secret, unquote(secret)}
    octets = {*map(_utf8, texts), unquote_to_bytes(_utf8(secret))}
    once = texts | {escaped for text in texts for escaped in _escaped(text)}
    for raw in octets:
        once.update({quote(raw, safe=""), quote(raw)})
        # bytes' repr() picks its quote the way str's does (see _escaped).
        once.update({repr(raw)[2:-1], repr(b"'\"" + raw)[5:-1]})
    # Escaped once more: the repr() of an exception whose message holds a repr().
    return once | {twice for form in once for twice in _escaped(form)}


def _escaped(text: str) -> Iterator[str]:
    # repr() escapes a ' only in a text that also holds a '"', so the same password
    # comes out two ways; JSON writes non-ASCII as \uXXXX or as it is.
    yield repr(text)[1:-1]
    yield repr("'\"" + text)[4:-1]
    yield json.dumps(text)[1:-1]
    yield json.dumps(text, ensure_ascii=False)[1:-1]


def _utf8(text: str) -> bytes:
    """The bytes a driver sends for ``text``: an environment variable or argument
    that was not UTF-8 holds its bytes as surrogates (PEP 383), and they go back to
    those bytes; a lone surrogate from anywhere else is kept as its own three bytes."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


def _spans(text: str, secrets: Iterable[str]) -> Iterator[tuple[int, int]]:
    """Where each secret occurs in ``text``, overlapping occurrences included."""
    for secret in secrets:
        start = text.find(secret)
        while start != -1:
            yield start, start + len(secret)
            start = text.find(secret, start + 1)


def _shape_spans(text: str) -> Iterator[tuple[int, int]]:
    """Where ``text`` holds a password by its shape (a URL's, libpq's, a dict's)."""
    patterns = (_KV_PASSWORD, _DICT_PASSWORD)
    for pattern in (_URL_PASSWORD, *patterns) if "://" in text else patterns:
        for match in pattern.finditer(text):
            yield match.span("secret")


def _masked(text: str, spans: Iterable[tuple[int, int]]) -> str:
    """``text`` with each run of overlapping or touching spans replaced by one MASK
    (an empty span, the password of ``amqp://u:@h``, still shows where one was)."""
    pieces: list[str] = []
    done = 0  # text[:done] is in pieces
    end = -1  # where the current run of spans ends
    for start, stop in sorted(spans):
        if start > end:
            pieces += [text[done:start], MASK]
        end = max(end, stop)
        done = max(done, stop)
    return "".join(pieces) + text[done:]


class Redactor:
    def __init__(self) -> None:
        self._secrets: tuple[str, ...] = ()
        self._lock = threading.Lock()

    def remember(self, *settings: str, refused: bool = False) -> None:
        """Mask the passwords of these connection settings from now on, everywhere."""
        new = set().union(*(secrets_in(s, refused=refused) for s in settings))
        with self._lock:
            self._secrets = tuple(sorted(set(self._secrets) | new))

    def remembered(self, text: str) -> str:
        """``text`` with the remembered passwords masked (by value only, no shapes)."""
        return _masked(text, _spans(text, self._secrets))

    def __call__(self, text: str) -> str:
        return _masked(text, [*_spans(text, self._secrets), *_shape_spans(text)])


_default = Redactor()


def remember(*settings: str, refused: bool = False) -> None:
    _default.remember(*settings, refused=refused)


def redact(text: str) -> str:
    return _default(text)


def redact_remembered(text: str) -> str:
    """Mask only the remembered passwords: for text whose shapes are not words, such
    as a whole HTML page (``password=\\S+`` would eat its markup)."""
    return _default.remembered(text)
