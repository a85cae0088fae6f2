"""Hints for the database errors of an operator's commands (``outbox parked``,
``outbox dead-letters``, the console's actions on them).

``outbox.db.session.translated`` words its hints for the daemons ("the relay
reconnects by itself", "the consumer retries with backoff"): an operator's command
is neither, nothing reconnects or retries it.  ``operator_hints`` gives those errors
an operator's hint instead: what the command's work came to, and to run it again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import errors as pgerrors

from outbox.db.session import ServerSilent
from outbox.errors import DatabaseRefused, DatabaseUnavailable, StatementTimedOut
from outbox.redaction import redact

AGAIN_SLOW = (
    "run the command again; if this repeats, look for what slows the server "
    "(pg_stat_activity) or raise --statement-timeout"
)
AGAIN_FAILED = "run the command again; check the server if this repeats"


@contextlib.contextmanager
def operator_hints(conn: psycopg.Connection[Any], lost: str) -> Iterator[None]:
    """Errors ``translated`` raises in the block (from a driver error on ``conn``)
    with an operator's hint: ``lost`` when the session is gone (the outcome of the
    statement unknown), to run the command again when a statement was cancelled or
    the server failed on a live session.  A lock wait's hint (what held it) and the
    other errors are kept."""
    try:
        yield
    except (DatabaseUnavailable, DatabaseRefused) as exc:
        cause = exc.__cause__
        if not isinstance(cause, psycopg.Error) or isinstance(cause, ServerSilent):
            # Not a driver error, or a server that stopped answering (its hint says
            # what to look for): the hint is already the command's own.
            raise
        if isinstance(exc, StatementTimedOut):
            if not isinstance(cause, pgerrors.LockNotAvailable):
                exc.hint = AGAIN_SLOW
        elif isinstance(exc, DatabaseRefused):
            # The default hint ends with "the relay retries with backoff".
            exc.hint = "look for a constraint or trigger added to the outbox tables"
        elif conn.broken or conn.closed:
            exc.hint = redact(lost)
        elif type(exc) is DatabaseUnavailable:
            exc.hint = AGAIN_FAILED
        raise
