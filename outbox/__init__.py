"""Transactional outbox relay from PostgreSQL to RabbitMQ with two-phase commit.

Applications call ``enqueue`` (or plain SQL) inside their own transaction; the
``outbox relay`` daemon publishes every committed row exactly once when nothing
crashes, and at least once when something does.
"""

from outbox.enqueue import (
    OutgoingMessage,
    enqueue,
    enqueue_async,
    enqueue_json,
    enqueue_json_async,
    enqueue_many,
    enqueue_many_async,
)

__version__ = "0.6.0"  # pyproject.toml's (tests/unit/test_release.py)

__all__ = [
    "OutgoingMessage",
    "enqueue",
    "enqueue_async",
    "enqueue_json",
    "enqueue_json_async",
    "enqueue_many",
    "enqueue_many_async",
]
