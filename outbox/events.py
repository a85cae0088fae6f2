"""Structured log events: a stable event name plus fields (gid, counts, …).

``emit(log, "batch.committed", gid=g, rows=n)`` writes ``batch.committed gid=… rows=…``
with the text formatter, and one JSON object per line with ``--log-format json``.
A thread may carry fields of its own (``context``): every event it emits carries
them first, e.g. ``database=<name>`` on every thread of one target of a fleet
(``outbox.fleet.process``); a thread that a target's thread starts (the heartbeat,
``outbox.relay.liveness``) takes them over with ``current_context``.

Every line passes ``redaction.redact`` on its way out (in ``emit`` for handlers of
an embedding application, in both formatters for every other record, tracebacks
included), so no password of a connection setting reaches a log.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from outbox.redaction import redact


class _Context(threading.local):
    fields: Mapping[str, Any] = {}


_context = _Context()


def current_context() -> dict[str, Any]:
    """The fields this thread adds to every event (to hand to a thread it starts)."""
    return dict(_context.fields)


@contextlib.contextmanager
def context(**fields: Any) -> Iterator[None]:
    """Add ``fields`` to every event this thread emits inside the block."""
    before = _context.fields
    _context.fields = {**before, **fields}
    try:
        yield
    finally:
        _context.fields = before


def emit(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    if not logger.isEnabledFor(level):
        return
    if _context.fields:
        fields = {**_context.fields, **fields}
    fields = {k: _redacted(v) for k, v in fields.items()}
    text = redact(" ".join([event, *(f"{k}={v}" for k, v in fields.items())]))
    logger.log(level, text, extra={"event": event, "fields": fields})


def json_line(
    level: int, logger: str, event: str, created: float | None = None, **fields: Any
) -> str:
    """One log entry as a JSON object (no newline), every string redacted."""
    stamp = datetime.datetime.fromtimestamp(
        time.time() if created is None else created, datetime.timezone.utc
    )
    entry: dict[str, Any] = {
        "ts": stamp.isoformat(timespec="milliseconds"),
        "level": logging.getLevelName(level).lower(),
        "logger": logger,
        "event": event,
    }
    entry.update(fields)
    # Redact the values, not the JSON text: json.dumps escapes quotes and
    # backslashes, and an escaped password no longer matches the one remembered.
    return json.dumps(_redacted(entry), default=lambda value: redact(str(value)))


def _redacted(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: _redacted(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redacted(v) for v in value]
    return value


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = dict(getattr(record, "fields", {}) or {})
        if record.exc_info:
            fields["exception"] = self.formatException(record.exc_info)
        return json_line(
            record.levelno,
            record.name,
            getattr(record, "event", None) or record.getMessage(),
            record.created,
            **fields,
        )


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def configure(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("pika").setLevel(logging.CRITICAL)
