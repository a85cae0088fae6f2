"""The options, error reporting and settings every command shares."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import click

from outbox import redaction
from outbox.cli.options import (
    AmqpUrlType,
    DsnType,
    LedgerMaxAge,
    QueueName,
    limited,
)
from outbox.config import (
    DEFAULT_AMQP_URL,
    DEFAULT_DSN,
    ORDERING_DEAD_LETTERS,
    Settings,
)
from outbox.errors import OutboxError
from outbox.events import json_line

if TYPE_CHECKING:
    from outbox.fleet.targets import TargetSource

F = TypeVar("F", bound=Callable[..., Any])


def env_option(name: str, env: str, **kwargs: Any) -> Callable[[F], F]:
    return click.option(name, envvar=env, show_envvar=True, show_default=True, **kwargs)


def wants_json(ctx: click.Context | None, args: Sequence[str] = ()) -> bool:
    """Whether errors must be JSON: ``--log-format json`` (parsed or not yet) or its env."""
    while ctx is not None:
        if "log_format" in ctx.params:
            return bool(ctx.params["log_format"] == "json")
        ctx = ctx.parent
    for index, arg in enumerate(args):
        if arg == "--log-format=json" or (
            arg == "--log-format" and args[index + 1 : index + 2] == ["json"]
        ):
            return True
    return os.environ.get("OUTBOX_LOG_FORMAT", "").strip().lower() == "json"


def report_error(message: str, hint: str = "", *, code: int, as_json: bool, **fields: Any) -> None:
    """One ``error:`` line (and a hint), or one JSON object, on stderr; passwords masked."""
    message, hint = redaction.redact(message), redaction.redact(hint)
    if as_json:
        entry = {"error": message, "hint": hint or None, "exit_code": code, **fields}
        click.echo(json_line(logging.ERROR, "outbox.cli", "cli.error", **entry), err=True)
        return
    click.echo(f"error: {message}", err=True)
    if hint:
        click.echo(f"  hint: {hint}", err=True)


def apply(func: F, decorators: Sequence[Callable[[F], F]]) -> F:
    """Apply option decorators so that ``--help`` lists them in the order given."""
    for decorator in reversed(decorators):
        func = decorator(func)
    return func


# One definition of each option that several commands share: the relay's and the
# consumer's commands check URLs, ranges and names the same way (exit 2, one line).
def dsn_option(help: str) -> Callable[[F], F]:
    return env_option("--dsn", "OUTBOX_DSN", default=DEFAULT_DSN, type=DsnType(), help=help)


RELAY_DSN_HELP = (
    "PostgreSQL connection (libpq conninfo or URL; TLS: sslmode=verify-full sslrootcert=FILE)."
)
CONSUMER_DSN_HELP = "The consumer's PostgreSQL: the handler's effects and the inbox."

amqp_url_option = env_option(
    "--amqp-url",
    "OUTBOX_AMQP_URL",
    default=DEFAULT_AMQP_URL,
    type=AmqpUrlType(),
    help="RabbitMQ connection URL (amqp:// or amqps://); a cluster's nodes "
    "separated by ';' (the first that answers is used; on failure, the next).",
)
connect_timeout_option = env_option(
    "--connect-timeout",
    "OUTBOX_CONNECT_TIMEOUT",
    default=Settings.connect_timeout,
    type=limited("connect_timeout"),
    help="Seconds to wait when connecting to either server.",
)
backoff_initial_option = env_option(
    "--backoff-initial",
    "OUTBOX_BACKOFF_INITIAL",
    default=Settings.backoff_initial,
    type=limited("backoff_initial"),
    help="First retry delay (s) after an outage; doubles up to --backoff-max.",
)
backoff_max_option = env_option(
    "--backoff-max",
    "OUTBOX_BACKOFF_MAX",
    default=Settings.backoff_max,
    type=limited("backoff_max"),
    help="Longest retry delay (s).",
)
# Every operator command's sessions are bounded (``outbox.db.session.connect``).
statement_timeout_option = env_option(
    "--statement-timeout",
    "OUTBOX_STATEMENT_TIMEOUT",
    default=Settings.statement_timeout,
    type=limited("statement_timeout"),
    help="Bound (s) on every statement; a command whose statement is cancelled exits 6.",
)
lock_timeout_option = env_option(
    "--lock-timeout",
    "OUTBOX_LOCK_TIMEOUT",
    default=Settings.lock_timeout,
    type=limited("lock_timeout"),
    help="Bound (s) on each wait for a lock (e.g. a row held by an in-doubt batch); "
    "the command then exits 6 naming what held it.",
)


def operator_session_options(func: F) -> F:
    """``--statement-timeout`` and ``--lock-timeout`` of a command that has no
    ``tuning_options`` (those give ``--statement-timeout``: add ``lock_timeout_option``)."""
    return apply(func, [statement_timeout_option, lock_timeout_option])


log_level_option = env_option(
    "--log-level",
    "OUTBOX_LOG_LEVEL",
    default="info",
    type=click.Choice(["debug", "info", "warning", "error"]),
)
log_format_option = env_option(
    "--log-format",
    "OUTBOX_LOG_FORMAT",
    default="text",
    type=click.Choice(["text", "json"]),
)
metrics_port_option = env_option(
    "--metrics-port",
    "OUTBOX_METRICS_PORT",
    default=0,
    type=click.IntRange(0, 65535),
    help="Serve /metrics, /healthz and /readyz on this port (0: off).",
)
metrics_address_option = env_option(
    "--metrics-address",
    "OUTBOX_METRICS_ADDRESS",
    default="0.0.0.0",
    help="Address the metrics and health endpoints listen on.",
)


def server_options(func: F) -> F:
    return apply(
        func,
        [
            dsn_option(RELAY_DSN_HELP),
            amqp_url_option,
            env_option(
                "--amqp-ca-file",
                "OUTBOX_AMQP_CA_FILE",
                default=None,
                type=click.Path(exists=True, dir_okay=False),
                help="CA certificate(s) (PEM) an amqps:// broker must be signed by "
                "[default: the system's trusted CAs].",
            ),
            env_option(
                "--table", "OUTBOX_TABLE", default=Settings.table, help="Outbox table name."
            ),
            env_option(
                "--ledger-queue",
                "OUTBOX_LEDGER_QUEUE",
                default=Settings.ledger_queue,
                type=QueueName(),
                help="Stream queue recording finished batches (resolver evidence).",
            ),
            log_level_option,
            log_format_option,
        ],
    )


def tuning_options(func: F) -> F:
    defaults = Settings()
    for decorator in reversed(
        [
            env_option(
                "--batch-size",
                "OUTBOX_BATCH_SIZE",
                default=defaults.batch_size,
                type=limited("batch_size"),
                help="Most rows per batch (one prepared transaction).",
            ),
            env_option(
                "--batch-max-bytes",
                "OUTBOX_BATCH_MAX_BYTES",
                default=defaults.batch_max_bytes,
                type=limited("batch_max_bytes"),
                help="Most payload bytes per batch (a larger row goes alone).",
            ),
            env_option(
                "--pipeline/--no-pipeline",
                "OUTBOX_PIPELINE",
                default=defaults.pipeline,
                help="Prepare the next batch while the broker confirms the current one.",
            ),
            env_option(
                "--publish-timeout",
                "OUTBOX_PUBLISH_TIMEOUT",
                default=defaults.publish_timeout,
                type=limited("publish_timeout"),
                help="Seconds to wait for publisher confirms before rolling back.",
            ),
            env_option(
                "--poll-interval",
                "OUTBOX_POLL_INTERVAL",
                default=defaults.poll_interval,
                type=limited("poll_interval"),
                help="Fallback poll (s) when no NOTIFY wakes the relay.",
            ),
            env_option(
                "--heartbeat-interval",
                "OUTBOX_HEARTBEAT_INTERVAL",
                default=defaults.heartbeat_interval,
                type=limited("heartbeat_interval"),
                help="Seconds between heartbeats of the relay's registry row.",
            ),
            env_option(
                "--relay-timeout",
                "OUTBOX_RELAY_TIMEOUT",
                default=defaults.relay_timeout,
                type=limited("relay_timeout"),
                help="Heartbeat age after which a relay is presumed partitioned.",
            ),
            env_option(
                "--resolve-interval",
                "OUTBOX_RESOLVE_INTERVAL",
                default=defaults.resolve_interval,
                type=limited("resolve_interval"),
                help="Seconds between passes that resolve dead relays' batches.",
            ),
            env_option(
                "--rescan-interval",
                "OUTBOX_RESCAN_INTERVAL",
                default=defaults.rescan_interval,
                type=limited("rescan_interval"),
                help="Seconds between passes of the safety net over the whole outbox.",
            ),
            env_option(
                "--ledger-max-age",
                "OUTBOX_LEDGER_MAX_AGE",
                default=defaults.ledger_max_age,
                type=LedgerMaxAge(),
                help="Retention of the ledger stream (x-max-age, e.g. 7D, 12h).",
            ),
            env_option(
                "--ledger-clock-skew",
                "OUTBOX_LEDGER_CLOCK_SKEW",
                default=defaults.ledger_clock_skew,
                type=limited("ledger_clock_skew"),
                help="Seconds before a batch's PREPARE the resolver starts reading the ledger.",
            ),
            backoff_initial_option,
            backoff_max_option,
            connect_timeout_option,
            env_option(
                "--statement-timeout",
                "OUTBOX_STATEMENT_TIMEOUT",
                default=defaults.statement_timeout,
                type=limited("statement_timeout"),
                help="Bound (s) on every statement of the relay; a cancelled one is retried.",
            ),
            env_option(
                "--max-message-bytes",
                "OUTBOX_MAX_MESSAGE_BYTES",
                default=defaults.max_message_bytes,
                type=limited("max_message_bytes"),
                help="Largest payload the broker accepts (max_message_size).",
            ),
            env_option(
                "--ordering-dead-letters",
                "OUTBOX_ORDERING_DEAD_LETTERS",
                default=defaults.ordering_dead_letters,
                type=click.Choice(list(ORDERING_DEAD_LETTERS)),
                help="A dead letter with an ordering key: 'block' holds the key's later "
                "messages back with it (no gap), 'skip' lets them go on.",
            ),
        ]
    ):
        func = decorator(func)
    return func


def settings_from(**options: Any) -> Settings:
    fields = {f.name for f in dataclasses.fields(Settings)}
    try:
        return Settings(**{k: v for k, v in options.items() if k in fields})
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


def known_errors(func: F) -> F:
    """Print a known condition as one clear line plus a hint, never a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except OutboxError as exc:
            as_json = wants_json(click.get_current_context(silent=True))
            report_error(exc.message, exc.hint, code=int(exc.exit_code), as_json=as_json)
            sys.exit(int(exc.exit_code))

    return wrapper  # type: ignore[return-value]


ORDERING_KEY_OPTION = click.option(
    "--ordering-key",
    "ordering_keys",
    multiple=True,
    metavar="KEY",
    help="Every dead letter of this ordering key (repeatable).",
)


# -- the consumer side: outbox consume, outbox parked ---------------------------------
def inbox_table_option(func: F) -> F:
    # The consumer's store, not its loop: the CLI must not import kombu (which imports Django
    # when it is installed) unless a consumer command runs.
    from outbox.db.inbox import DEFAULT_INBOX_TABLE

    return env_option(
        "--inbox-table",
        "OUTBOX_INBOX_TABLE",
        default=DEFAULT_INBOX_TABLE,
        help="Inbox table in the consumer's database; its companions are "
        "<table>_attempts and <table>_parked.",
    )(func)


def consumer_server_options(func: F) -> F:
    return apply(
        func,
        [
            dsn_option(CONSUMER_DSN_HELP),
            amqp_url_option,
            inbox_table_option,
            connect_timeout_option,
        ],
    )


def own_servers_options(func: F) -> F:
    """``--dsn`` (optional: a private PostgreSQL is started without it) and ``--amqp-url``."""
    func = click.option(
        "--amqp-url",
        envvar="OUTBOX_AMQP_URL",
        show_envvar=True,
        default=DEFAULT_AMQP_URL,
        show_default=True,
        type=AmqpUrlType(),
    )(func)
    return click.option(
        "--dsn",
        envvar="OUTBOX_DSN",
        show_envvar=True,
        default=None,
        type=DsnType(),
        help="Use this PostgreSQL (needs max_prepared_transactions > 0) "
        "instead of starting a private one (fsync on).",
    )(func)


def targets_options(func: F) -> F:
    """``--targets FILE`` or ``--discover DSN`` (with ``--databases``): the databases
    of a fleet (``outbox.fleet.targets``); without either, the one ``--dsn`` names."""
    return apply(
        func,
        [
            env_option(
                "--targets",
                "OUTBOX_TARGETS",
                default=None,
                type=click.Path(dir_okay=False),
                help="Serve every database this file lists (one PostgreSQL DSN per line; "
                "read again when it changes) instead of --dsn.",
            ),
            env_option(
                "--discover",
                "OUTBOX_DISCOVER",
                default=None,
                type=DsnType(),
                help="Serve every database of the server this DSN reaches that matches "
                "--databases and has the outbox table, instead of --dsn.",
            ),
            env_option(
                "--databases",
                "OUTBOX_DATABASES",
                default="*",
                help="With --discover: the databases to look at (shell patterns, comma-separated).",
            ),
        ],
    )


def target_source(
    targets: str | None,
    discover: str | None,
    databases: str,
    settings: Settings,
    *,
    interval: float = 5.0,
) -> TargetSource | None:
    """The fleet's ``TargetSource`` for ``targets_options``' values, or None when
    neither ``--targets`` nor ``--discover`` is given (one database: ``--dsn``)."""
    from outbox.fleet.targets import TargetSource

    if targets is None and discover is None:
        return None
    return TargetSource(
        file=targets,
        discover=discover,
        pattern=databases,
        table=settings.table,
        interval=interval,
        connect_timeout=settings.connect_timeout,
        statement_timeout=settings.statement_timeout,
    )
