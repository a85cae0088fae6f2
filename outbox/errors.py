"""The project's exceptions and the CLI's exit codes.

Driver errors (psycopg, pika) are translated into these at the boundary of
``store.py``, ``publisher.py`` and ``ledger.py``; nothing above those modules
catches a driver exception.  Every error a user can cause or fix carries a
``hint`` saying what to do, and the CLI prints ``error: <message>\\n  <hint>``
instead of a traceback.  Both are passed through ``redaction.redact`` first, so
whatever a driver quoted from a connection setting, no password gets out.
"""

from __future__ import annotations

import enum

from outbox.redaction import redact


class ExitCode(enum.IntEnum):
    """Documented exit codes of the ``outbox`` command (docs/reference/exit-codes.md)."""

    OK = 0
    FAILURE = 1  # unexpected error, or ``status`` found something needing attention
    USAGE = 2  # bad command line (click's own code)
    UNREACHABLE = 3  # PostgreSQL or RabbitMQ cannot be reached
    NOT_READY = 4  # database not ready: prepared transactions disabled, schema missing/old,
    # or a privilege missing
    SCHEMA_TOO_NEW = 5  # the schema was migrated by a newer outbox-relay than this one
    TIMED_OUT = 6  # a statement or lock wait outlived --statement-timeout/--lock-timeout
    # (the error names what held it), a publish its --publish-timeout, or an operator's
    # commit the synchronous standby it waits for
    INTERRUPTED = 130  # Ctrl-C (SIGINT) before the command finished: 128 + SIGINT


class OutboxError(Exception):
    """Base class: a known condition with a message and a hint for the operator."""

    exit_code: ExitCode = ExitCode.FAILURE

    # The relay write that failed ("claim", "prepare", "dead_letters", "ledger",
    # "commit_prepared", "rollback_prepared"), set where the relay catches it.
    write: str | None = None

    def __init__(self, message: str, hint: str = "") -> None:
        message, hint = redact(message), redact(hint)
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class DatabaseUnavailable(OutboxError):
    """PostgreSQL cannot be reached or the connection was lost."""

    exit_code = ExitCode.UNREACHABLE


class BrokerUnavailable(OutboxError):
    """RabbitMQ cannot be reached, refused us, or the connection was lost."""

    exit_code = ExitCode.UNREACHABLE


class ConfirmTimedOut(BrokerUnavailable):
    """An operator's publish (``outbox parked retry``) got no confirm within its
    ``--publish-timeout``: whether the broker has the message is unknown."""

    exit_code = ExitCode.TIMED_OUT


class NotTaken(OutboxError):
    """An operator's publish (``outbox parked retry``) of one message the broker did
    not take and said why (returned unroutable: its queue is gone; nacked), or that
    could not be sent at all: it stays where it was, the next one can be sent."""


class BrokerBlocked(BrokerUnavailable):
    """RabbitMQ is blocking publishers (a resource alarm): the connection lives."""


class BatchNotConfirmed(BrokerUnavailable):
    """RabbitMQ nacked a batch's messages while the connection lives: the confirms
    of another batch on it still arrive."""


class PreparedTransactionsDisabled(OutboxError):
    """``max_prepared_transactions`` is 0 on the server."""

    exit_code = ExitCode.NOT_READY


class SchemaNotReady(OutboxError):
    """The outbox schema is missing or older than this version of the relay."""

    exit_code = ExitCode.NOT_READY


class SchemaTooNew(OutboxError):
    """The schema is newer than this version knows: running against it could be wrong."""

    exit_code = ExitCode.SCHEMA_TOO_NEW


class InvalidSetting(OutboxError):
    """A setting that cannot work, found only when it is used (e.g. an unreadable CA file)."""

    exit_code = ExitCode.USAGE


class MissingExtra(OutboxError):
    """A command needs an optional part of the package that is not installed (the hint
    names the extra to install)."""

    exit_code = ExitCode.USAGE


class MissingPrivileges(OutboxError):
    """The database role lacks a privilege the command needs (the hint has the GRANT)."""

    exit_code = ExitCode.NOT_READY


class DatabaseRefused(OutboxError):
    """PostgreSQL refused a statement on a live session for a reason that is not a
    timeout, a privilege or a lost connection: a constraint or a trigger someone
    added, a value it cannot store.  The relay retries it with backoff."""


class DeadLettersUnwritable(DatabaseUnavailable):
    """PostgreSQL refused to record dead letters, whatever the error (a revoked
    INSERT, a lock held past the timeout, a constraint): the batch is rolled back,
    and nothing more is published until its dead letters are written first."""


class PreparedSlotsExhausted(OutboxError):
    """Every prepared-transaction slot of the server is in use (transient)."""


class OutcomeUnknown(OutboxError):
    """A PREPARE or COMMIT PREPARED was cut off: its result must be looked up."""


class GidHeld(OutcomeUnknown):
    """Another session is preparing or finishing this gid right now (55000, busy):
    its result is not known yet, and it must be looked up again later."""


class StatementTimedOut(DatabaseUnavailable):
    """PostgreSQL cancelled a statement (``statement_timeout``/``lock_timeout``): the
    relay and the consumer retry it; an operator's command exits 6, naming what held it."""

    exit_code = ExitCode.TIMED_OUT


class CommitAwaitsStandby(DatabaseUnavailable):
    """An operator's statement took effect on the primary, whose commit then waited
    for a synchronous standby (``synchronous_standby_names``) past the client deadline:
    the session was given up, the change stays committed on the primary.  Exit 6."""

    exit_code = ExitCode.TIMED_OUT


class RowsHeld(OutboxError):
    """An action met rows another transaction holds: an in-doubt batch (``gids``),
    or a lock not released within the action's ``lock_timeout``.  Nothing was done."""

    def __init__(self, gids: list[str], what: str) -> None:
        self.gids = gids
        if gids:
            super().__init__(
                f"{what}: held by in-doubt batch {', '.join(gids)}: resolve it first",
                "run a resolver pass (outbox resolve, or the console's In-doubt page)",
            )
        else:
            super().__init__(
                f"{what}: the rows are locked by another transaction",
                "try again in a moment; pg_locks names the holder if this repeats",
            )
