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
  wherever it shows up: as written, percent-decoded or -encoded, or escaped by
  ``repr`` or JSON.  Drivers
  quote a password without its URL around it (``invalid percent-encoded token:
  "S3cr%tPG"``); only the value says it is one.

Passwords shorter than ``MIN_REMEMBERED`` characters are masked by shape only:
replacing every "ab" in a log line would make the log unreadable.  A password
equal to its user name is not secret from anyone who reads the user name.
"""

from __future__ import annotations

import json
import re
import threading
from urllib.parse import quote, unquote

MASK = "***"
MIN_REMEMBERED = 3

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
# scheme://user:password@ — the password runs to the last '@' of the word.
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^\s:@;]*):[^\s;]*@")
_KEY = r"(?i:\b(?:\w*password|\w*secret|scram_\w+_key))"
# libpq key=value (and URL query) form; a quoted value may hold escaped quotes.
_KV_PASSWORD = re.compile(r"(?P<key>" + _KEY + r"\s*=\s*)(?:'(?:[^'\\]|\\.)*(?:'|$)|\S+)")
# Python/JSON dict form, e.g. pika's ssl_options={'password': '…'}.
_DICT_PASSWORD = re.compile(
    r"""(?P<key>['"]""" + _KEY + r"""['"]\s*:\s*)(?P<q>['"])(?:\\.|(?!(?P=q)).)*(?P=q)?"""
)


def _mask_url(match: re.Match[str]) -> str:
    return f"{match.group('head')}:{MASK}@"


def _mask_kv(match: re.Match[str]) -> str:
    return match.group("key") + MASK


def _mask_dict(match: re.Match[str]) -> str:
    return f"{match.group('key')}{match.group('q')}{MASK}{match.group('q')}"


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
    variants = set()
    for secret in found:
        for form in (secret, unquote(secret)):
            # As written, percent-encoded, and escaped the way repr() and JSON
            # quote it inside an exception's message or a log field.
            variants.update({form, quote(form, safe=""), quote(form)})
            variants.update({repr(form)[1:-1], json.dumps(form)[1:-1]})
    return {s for s in variants if len(s) >= MIN_REMEMBERED}


class Redactor:
    def __init__(self) -> None:
        self._secrets: tuple[str, ...] = ()
        self._lock = threading.Lock()

    def remember(self, *settings: str, refused: bool = False) -> None:
        """Mask the passwords of these connection settings from now on, everywhere."""
        new = set().union(*(secrets_in(s, refused=refused) for s in settings))
        with self._lock:
            merged = set(self._secrets) | new
            # Longest first, so a password is masked before any shorter one inside it.
            self._secrets = tuple(sorted(merged, key=len, reverse=True))

    def remembered(self, text: str) -> str:
        """``text`` with the remembered passwords masked (by value only, no shapes)."""
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, MASK)
        return text

    def __call__(self, text: str) -> str:
        text = self.remembered(text)
        if "://" in text:
            text = _URL_PASSWORD.sub(_mask_url, text)
        text = _KV_PASSWORD.sub(_mask_kv, text)
        return _DICT_PASSWORD.sub(_mask_dict, text)


_default = Redactor()


def remember(*settings: str, refused: bool = False) -> None:
    _default.remember(*settings, refused=refused)


def redact(text: str) -> str:
    return _default(text)


def redact_remembered(text: str) -> str:
    """Mask only the remembered passwords: for text whose shapes are not words, such
    as a whole HTML page (``password=\\S+`` would eat its markup)."""
    return _default.remembered(text)
