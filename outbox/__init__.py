"""Transactional outbox relay from PostgreSQL to RabbitMQ with two-phase commit.

Applications call ``enqueue`` (or plain SQL) inside their own transaction; the
``outbox relay`` daemon publishes every committed row exactly once when nothing
crashes, and at least once when something does.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from outbox._version import __version__ as __version__
    from outbox.enqueue import (
        OutgoingMessage,
        cancel,
        cancel_async,
        enqueue,
        enqueue_async,
        enqueue_json,
        enqueue_json_async,
        enqueue_many,
        enqueue_many_async,
    )


__all__ = [
    "OutgoingMessage",
    "cancel",
    "cancel_async",
    "enqueue",
    "enqueue_async",
    "enqueue_json",
    "enqueue_json_async",
    "enqueue_many",
    "enqueue_many_async",
]


def __getattr__(name: str) -> Any:
    """The API is imported on first use: ``import outbox`` (which every ``outbox.*``
    import runs first) loads no driver, so the ``outbox`` command's entry point
    (``outbox.entry``) runs before anything slow is imported."""
    if name in __all__:
        return getattr(importlib.import_module("outbox.enqueue"), name)
    if name == "__version__":
        # Read on use as well: ``import outbox`` imports no module of its own, so
        # the command takes SIGINT (``outbox.entry``) before any outbox module loads.
        return importlib.import_module("outbox._version").__version__
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(types.ModuleType):
    """``outbox.enqueue`` is the function, as it always was, though a submodule has
    the same name: once the submodule is loaded, the import system sets it as the
    package's attribute ``enqueue``; the function is set instead."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "enqueue" and isinstance(value, types.ModuleType):
            value = value.enqueue
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
