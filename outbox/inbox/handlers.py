"""The handler ``outbox consume MODULE:FUNCTION`` names: its type (``Handler``) and
how it is imported (``load_handler``, ``HandlerNotFound``)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import psycopg

from outbox.amqp.message import InboxMessage
from outbox.db.inbox import describe
from outbox.errors import ExitCode, OutboxError


class HandlerNotFound(OutboxError):
    """``MODULE:FUNCTION`` cannot be imported."""

    exit_code = ExitCode.USAGE


Handler = Callable[["psycopg.Connection[Any]", InboxMessage], object]


def load_handler(spec: str) -> Handler:
    """Import ``FUNCTION`` from ``MODULE`` (``MODULE:FUNCTION``), with the current
    directory on the path as other workers' ``--app`` options do."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise HandlerNotFound(
            f"{spec!r} is not MODULE:FUNCTION", "e.g. `outbox consume handlers:on_order`"
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise HandlerNotFound(
            f"cannot import module {module_name!r}: {exc}",
            "run from the folder that holds it, or add that folder to PYTHONPATH",
        ) from exc
    except Exception as exc:
        raise HandlerNotFound(f"importing {module_name!r} failed: {describe(exc)}") from exc
    target: Any = module
    for part in attribute.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise HandlerNotFound(f"module {module_name!r} has no {attribute!r}")
    if not callable(target):
        raise HandlerNotFound(f"{spec!r} is not callable")
    return target  # type: ignore[no-any-return]
