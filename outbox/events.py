"""Structured log events: a stable event name plus fields (gid, counts, …).

``emit(log, "batch.committed", gid=g, rows=n)`` writes ``batch.committed gid=… rows=…``
with the text formatter, and one JSON object per line with ``--log-format json``.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any


def emit(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    if not logger.isEnabledFor(level):
        return
    text = " ".join([event, *(f"{k}={v}" for k, v in fields.items())])
    logger.log(level, text, extra={"event": event, "fields": fields})


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": getattr(record, "event", None) or record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}) or {})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("pika").setLevel(logging.CRITICAL)
