"""The ``outbox`` command: each subcommand is thin and calls the modules below.

Exit codes (also in the README): 0 ok; 1 failure, or ``status`` found something
that needs attention; 2 usage (a bad option, value or file); 3 PostgreSQL or
RabbitMQ unreachable; 4 database not ready (prepared transactions disabled, schema
missing or too old); 5 schema newer than this version.

Every error is one line (``error: …`` and maybe ``  hint: …``), or one JSON
object with ``--log-format json``, with every password masked
(``redaction.redact``); never a traceback, except for a bug (exit 1), and then a
redacted one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click

from outbox import redaction, urls
from outbox.bench.memory import DEFAULT_BACKLOGS as DEFAULT_MEMORY_BACKLOGS
from outbox.cli.options import (
    Age,
    AmqpUrlType,
    DsnType,
    FiniteFloatRange,
    LedgerMaxAge,
    QueueName,
    limited,
)
from outbox.config import (
    DAY,
    DEFAULT_AMQP_URL,
    DEFAULT_DSN,
    LIMITS,
    ORDERING_DEAD_LETTERS,
    Settings,
)
from outbox.db import migrate, privileges, store
from outbox.errors import ExitCode, OutboxError
from outbox.events import configure, emit, json_line

log = logging.getLogger("outbox.cli")

F = TypeVar("F", bound=Callable[..., Any])


def _option(name: str, env: str, **kwargs: Any) -> Callable[[F], F]:
    return click.option(name, envvar=env, show_envvar=True, show_default=True, **kwargs)


def _wants_json(ctx: click.Context | None, args: Sequence[str] = ()) -> bool:
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


def server_options(func: F) -> F:
    for decorator in reversed(
        [
            _option(
                "--dsn",
                "OUTBOX_DSN",
                default=DEFAULT_DSN,
                type=DsnType(),
                help="PostgreSQL connection (libpq conninfo or URL; TLS: sslmode=verify-full "
                "sslrootcert=FILE).",
            ),
            _option(
                "--amqp-url",
                "OUTBOX_AMQP_URL",
                default=DEFAULT_AMQP_URL,
                type=AmqpUrlType(),
                help="RabbitMQ connection URL (amqp:// or amqps://); a cluster's nodes "
                "separated by ';' (the first that answers is used; on failure, the next).",
            ),
            _option(
                "--amqp-ca-file",
                "OUTBOX_AMQP_CA_FILE",
                default=None,
                type=click.Path(exists=True, dir_okay=False),
                help="CA certificate(s) (PEM) an amqps:// broker must be signed by "
                "[default: the system's trusted CAs].",
            ),
            _option("--table", "OUTBOX_TABLE", default=Settings.table, help="Outbox table name."),
            _option(
                "--ledger-queue",
                "OUTBOX_LEDGER_QUEUE",
                default=Settings.ledger_queue,
                type=QueueName(),
                help="Stream queue recording finished batches (resolver evidence).",
            ),
            _option(
                "--log-level",
                "OUTBOX_LOG_LEVEL",
                default="info",
                type=click.Choice(["debug", "info", "warning", "error"]),
            ),
            _option(
                "--log-format",
                "OUTBOX_LOG_FORMAT",
                default="text",
                type=click.Choice(["text", "json"]),
            ),
        ]
    ):
        func = decorator(func)
    return func


def tuning_options(func: F) -> F:
    defaults = Settings()
    for decorator in reversed(
        [
            _option(
                "--batch-size",
                "OUTBOX_BATCH_SIZE",
                default=defaults.batch_size,
                type=limited("batch_size"),
                help="Most rows per batch (one prepared transaction).",
            ),
            _option(
                "--batch-max-bytes",
                "OUTBOX_BATCH_MAX_BYTES",
                default=defaults.batch_max_bytes,
                type=limited("batch_max_bytes"),
                help="Most payload bytes per batch (a larger row goes alone).",
            ),
            _option(
                "--pipeline/--no-pipeline",
                "OUTBOX_PIPELINE",
                default=defaults.pipeline,
                help="Prepare the next batch while the broker confirms the current one.",
            ),
            _option(
                "--publish-timeout",
                "OUTBOX_PUBLISH_TIMEOUT",
                default=defaults.publish_timeout,
                type=limited("publish_timeout"),
                help="Seconds to wait for publisher confirms before rolling back.",
            ),
            _option(
                "--poll-interval",
                "OUTBOX_POLL_INTERVAL",
                default=defaults.poll_interval,
                type=limited("poll_interval"),
                help="Fallback poll (s) when no NOTIFY wakes the relay.",
            ),
            _option(
                "--heartbeat-interval",
                "OUTBOX_HEARTBEAT_INTERVAL",
                default=defaults.heartbeat_interval,
                type=limited("heartbeat_interval"),
                help="Seconds between heartbeats of the relay's registry row.",
            ),
            _option(
                "--relay-timeout",
                "OUTBOX_RELAY_TIMEOUT",
                default=defaults.relay_timeout,
                type=limited("relay_timeout"),
                help="Heartbeat age after which a relay is presumed partitioned.",
            ),
            _option(
                "--resolve-interval",
                "OUTBOX_RESOLVE_INTERVAL",
                default=defaults.resolve_interval,
                type=limited("resolve_interval"),
                help="Seconds between passes that resolve dead relays' batches.",
            ),
            _option(
                "--ledger-max-age",
                "OUTBOX_LEDGER_MAX_AGE",
                default=defaults.ledger_max_age,
                type=LedgerMaxAge(),
                help="Retention of the ledger stream (x-max-age, e.g. 7D, 12h).",
            ),
            _option(
                "--ledger-clock-skew",
                "OUTBOX_LEDGER_CLOCK_SKEW",
                default=defaults.ledger_clock_skew,
                type=limited("ledger_clock_skew"),
                help="Seconds before a batch's PREPARE the resolver starts reading the ledger.",
            ),
            _option(
                "--backoff-initial",
                "OUTBOX_BACKOFF_INITIAL",
                default=defaults.backoff_initial,
                type=limited("backoff_initial"),
                help="First retry delay (s) after an outage; doubles up to --backoff-max.",
            ),
            _option(
                "--backoff-max",
                "OUTBOX_BACKOFF_MAX",
                default=defaults.backoff_max,
                type=limited("backoff_max"),
                help="Longest retry delay (s).",
            ),
            _option(
                "--connect-timeout",
                "OUTBOX_CONNECT_TIMEOUT",
                default=defaults.connect_timeout,
                type=limited("connect_timeout"),
                help="Seconds to wait when connecting to either server.",
            ),
            _option(
                "--statement-timeout",
                "OUTBOX_STATEMENT_TIMEOUT",
                default=defaults.statement_timeout,
                type=limited("statement_timeout"),
                help="Bound (s) on every statement of the relay; a cancelled one is retried.",
            ),
            _option(
                "--max-message-bytes",
                "OUTBOX_MAX_MESSAGE_BYTES",
                default=defaults.max_message_bytes,
                type=limited("max_message_bytes"),
                help="Largest payload the broker accepts (max_message_size).",
            ),
            _option(
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


def _settings(**options: Any) -> Settings:
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
            as_json = _wants_json(click.get_current_context(silent=True))
            report_error(exc.message, exc.hint, code=int(exc.exit_code), as_json=as_json)
            sys.exit(int(exc.exit_code))

    return wrapper  # type: ignore[return-value]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="outbox-relay")
def cli() -> None:
    """Transactional outbox relay: PostgreSQL → RabbitMQ with two-phase commit."""


@cli.command()
@server_options
@click.option("--print-sql", is_flag=True, help="Print the schema instead of applying it.")
@known_errors
def init(print_sql: bool, **options: Any) -> None:
    """Create or upgrade the outbox schema (idempotent, safe to run concurrently)."""
    settings = _settings(**options)
    if print_sql:
        click.echo(migrate.render_sql(settings.table), nl=False)
        return
    conn = store.connect(settings.dsn, application_name="outbox-init")
    try:
        before, after = migrate.migrate(conn, settings.table)
    finally:
        conn.close()
    if before == after:
        click.echo(f"schema of {settings.table!r} is up to date (version {after})")
    else:
        click.echo(f"schema of {settings.table!r} migrated from {before or 'nothing'} to {after}")


@cli.command()
@server_options
@tuning_options
@click.option("--drain", is_flag=True, help="Exit 0 once no claimable row is left.")
@_option(
    "--metrics-port",
    "OUTBOX_METRICS_PORT",
    default=0,
    type=click.IntRange(0, 65535),
    help="Serve /metrics, /healthz and /readyz on this port (0: off).",
)
@_option(
    "--metrics-address",
    "OUTBOX_METRICS_ADDRESS",
    default="0.0.0.0",
    help="Address the metrics and health endpoints listen on.",
)
@known_errors
def relay(
    drain: bool,
    metrics_port: int,
    metrics_address: str,
    log_level: str,
    log_format: str,
    **options: Any,
) -> None:
    """Publish committed outbox rows to RabbitMQ until SIGTERM/SIGINT."""
    from outbox.ops.endpoints import Endpoints
    from outbox.relay.process import Relay, StopFlag

    configure(log_level, log_format)
    settings = _settings(**options)
    stop = StopFlag()
    stop.install_signal_handlers()
    runner = Relay(settings, stop=stop)
    endpoints = None
    if metrics_port:
        try:
            endpoints = Endpoints(runner, port=metrics_port, address=metrics_address).start()
        except OSError as exc:
            raise click.UsageError(
                f"cannot listen on {metrics_address}:{metrics_port}: {exc.strerror}"
            ) from exc
        emit(log, "relay.endpoints", address=metrics_address, port=endpoints.port)
    try:
        runner.start()
        stats = runner.run(drain=drain)
    finally:
        if endpoints is not None:
            endpoints.close()
    if log_format == "json":  # log shippers want every stderr line to be JSON
        emit(
            log,
            "relay.stopped",
            published=stats.messages_published,
            committed=stats.batches_committed,
            rolled_back=stats.batches_rolled_back,
            dead_letters=stats.dead_letters,
            duplicates_possible=stats.duplicates_possible,
            slowest_claim_ms=round(stats.slowest_claim * 1000, 1),
            largest_claim=stats.largest_claim,
        )
    else:
        click.echo(
            f"relay stopped: {stats.messages_published} published, "
            f"{stats.batches_committed} batches committed, {stats.dead_letters} dead letters",
            err=True,
        )


@cli.command()
@server_options
@tuning_options
@click.option(
    "--dry-run", is_flag=True, help="Show each decision and its evidence; change nothing."
)
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@known_errors
def resolve(dry_run: bool, as_json: bool, log_level: str, log_format: str, **options: Any) -> None:
    """Resolve in-doubt batches of dead relays once (relays also do this by themselves)."""
    from resolver import resolve as resolve_pass

    configure(log_level, log_format)
    settings = _settings(**options)
    batch_store = store.BatchStore(settings.dsn, settings.table, application_name="outbox-resolve")
    try:
        # Privileges first: reading the schema version needs one of them.
        batch_store.check_privileges(privileges.RESOLVE, "outbox resolve")
        migrate.refuse_newer(
            migrate.current_version(batch_store.conn, settings.table), settings.table
        )
        results = resolve_pass(batch_store, settings, dry_run=dry_run)
    finally:
        batch_store.close()
    if as_json:
        click.echo(
            json.dumps({"dry_run": dry_run, "batches": [r.as_dict() for r in results]}, indent=2)
        )
        return
    if not results:
        click.echo("no prepared transactions in this cluster")
    for r in results:
        evidence = {True: "in ledger", False: "not in ledger", None: "-"}[r.evidence]
        click.echo(
            f"{r.gid}  age={r.age_seconds:.0f}s  owner={r.decision.owner.value}  "
            f"evidence={evidence}  action={r.decision.action.value}  "
            f"outcome={r.outcome}  ({r.decision.why})"
        )


@cli.command()
@server_options
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.option(
    "--max-prepared-age",
    envvar="OUTBOX_MAX_PREPARED_AGE",
    show_envvar=True,
    default=60.0,
    show_default=True,
    type=FiniteFloatRange(0, 365 * 86400),
    help="A prepared batch older than this (s) needs attention (exit 1).",
)
@_option(
    "--max-backlog-age",
    "OUTBOX_MAX_BACKLOG_AGE",
    default=300.0,
    type=FiniteFloatRange(0, 365 * 86400),
    help="An outbox row older than this (s) needs attention (exit 1).",
)
@known_errors
def status(
    as_json: bool,
    max_prepared_age: float,
    max_backlog_age: float,
    log_level: str,
    log_format: str,
    **options: Any,
) -> None:
    """Backlog, prepared batches, live relays and dead letters; exit 1 if attention needed."""
    from outbox.ops.status import collect, render

    settings = _settings(**options)
    report = collect(settings, max_prepared_age=max_prepared_age, max_backlog_age=max_backlog_age)
    click.echo(json.dumps(report, indent=2, default=str) if as_json else render(report))
    if report["attention"]:
        sys.exit(int(ExitCode.FAILURE))


@cli.group("dead-letters")
def dead_letters() -> None:
    """Rows that can never be published as they are: list, retry after a fix, purge."""


def _dead_letter_store(options: dict[str, Any]) -> store.DeadLetterStore:
    from outbox.ops.deadletters import open_store

    return open_store(_settings(**options))


def _message_ids(texts: Sequence[str], ordering_keys: Sequence[str] = ()) -> Any:
    from outbox.ops.deadletters import parse_ids

    try:
        return parse_ids(texts, ordering_keys)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


@dead_letters.command("list")
@server_options
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.option(
    "--limit",
    default=1000,
    show_default=True,
    type=click.IntRange(1, 2**31 - 1),
    help="Show at most this many.",
)
@known_errors
def dead_letters_list(
    as_json: bool, limit: int, log_level: str, log_format: str, **options: Any
) -> None:
    """Dead letters, oldest first: message id, reason, when, and where it was going."""
    from outbox.ops.deadletters import as_dict, render

    dl_store = _dead_letter_store(options)
    try:
        rows = dl_store.entries(limit)
    finally:
        dl_store.close()
    if as_json:
        click.echo(json.dumps({"dead_letters": [as_dict(r) for r in rows]}, indent=2))
    else:
        click.echo(render(rows))


_ORDERING_KEY_OPTION = click.option(
    "--ordering-key",
    "ordering_keys",
    multiple=True,
    metavar="KEY",
    help="Every dead letter of this ordering key (repeatable).",
)


@dead_letters.command("retry")
@server_options
@click.option("--all", "everything", is_flag=True, help="Retry every dead letter.")
@_ORDERING_KEY_OPTION
@click.argument("message_ids", nargs=-1)
@known_errors
def dead_letters_retry(
    everything: bool,
    ordering_keys: tuple[str, ...],
    message_ids: tuple[str, ...],
    log_level: str,
    log_format: str,
    **options: Any,
) -> None:
    """Put dead letters back into the outbox (same row id and message_id) once the cause
    is fixed.  A MESSAGE_ID selects every row carrying it; a number selects one row id;
    --ordering-key every dead letter of a key (a key held back by a dead letter is
    released this way, its messages in their original order).

    Exits 1 if a given MESSAGE_ID, row id or key has no dead letter.
    """
    selection = _message_ids(message_ids, ordering_keys)
    if everything == bool(selection):
        raise click.UsageError(
            "give either --all or one or more MESSAGE_IDs (or row ids, or --ordering-key)"
        )
    dl_store = _dead_letter_store(options)
    try:
        moved = dl_store.retry(
            everything=everything,
            message_ids=selection.message_ids,
            row_ids=selection.row_ids,
            ordering_keys=selection.ordering_keys,
        )
    finally:
        dl_store.close()
    click.echo(f"{len(moved)} dead letters moved back to the outbox")
    missing = selection.not_found(moved)
    if missing:
        click.echo("not dead letters: " + " ".join(missing), err=True)
        sys.exit(int(ExitCode.FAILURE))


@dead_letters.command("purge")
@server_options
@click.option("--all", "everything", is_flag=True, help="Delete every dead letter.")
@click.option(
    "--older-than",
    envvar="OUTBOX_DEAD_LETTERS_MAX_AGE",
    show_envvar=True,
    default=None,
    type=Age(),
    help="Only those that failed longer ago than this (e.g. 30d, 12h, 900s).",
)
@_ORDERING_KEY_OPTION
@click.argument("message_ids", nargs=-1)
@known_errors
def dead_letters_purge(
    everything: bool,
    older_than: str | None,
    ordering_keys: tuple[str, ...],
    message_ids: tuple[str, ...],
    log_level: str,
    log_format: str,
    **options: Any,
) -> None:
    """Delete dead letters for good: --all, --older-than AGE, and/or MESSAGE_IDs (every
    row carrying the id), row ids or --ordering-key KEY (every dead letter of the key).

    Exits 1 if a given id was not purged (not a dead letter, or younger than
    --older-than).
    """
    from outbox.ops.deadletters import parse_age

    named = bool(message_ids or ordering_keys)
    if everything and named:
        raise click.UsageError("give --all or MESSAGE_IDs (or --ordering-key), not both")
    if not (everything or named or older_than):
        raise click.UsageError(
            "say what to purge: --all, --older-than AGE, MESSAGE_IDs or --ordering-key"
        )
    try:
        age = parse_age(older_than) if older_than else None
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    selection = _message_ids(message_ids, ordering_keys)
    dl_store = _dead_letter_store(options)
    try:
        purged = dl_store.purge(
            everything=not named,
            message_ids=selection.message_ids,
            row_ids=selection.row_ids,
            ordering_keys=selection.ordering_keys,
            older_than=age,
        )
    finally:
        dl_store.close()
    click.echo(f"{len(purged)} dead letters purged")
    missing = selection.not_found(purged)
    if missing:
        why = "not dead letters" if age is None else "not dead letters, or younger than that"
        click.echo(f"{why}: " + " ".join(missing), err=True)
        sys.exit(int(ExitCode.FAILURE))


# -- the consumer side: outbox consume, outbox parked ---------------------------------
def inbox_table_option(func: F) -> F:
    # inbox_store, not inbox: the CLI must not import kombu (which imports Django
    # when it is installed) unless a consumer command runs.
    from outbox.inbox.store import DEFAULT_INBOX_TABLE

    return _option(
        "--inbox-table",
        "OUTBOX_INBOX_TABLE",
        default=DEFAULT_INBOX_TABLE,
        help="Inbox table in the consumer's database; its companions are "
        "<table>_attempts and <table>_parked.",
    )(func)


def consumer_server_options(func: F) -> F:
    for decorator in reversed(
        [
            _option(
                "--dsn",
                "OUTBOX_DSN",
                default=DEFAULT_DSN,
                help="The consumer's PostgreSQL: the handler's effects and the inbox.",
            ),
            _option(
                "--amqp-url",
                "OUTBOX_AMQP_URL",
                default=DEFAULT_AMQP_URL,
                help="RabbitMQ connection URL (';'-separated URLs: failover).",
            ),
            inbox_table_option,
            _option(
                "--connect-timeout",
                "OUTBOX_CONNECT_TIMEOUT",
                default=10.0,
                type=float,
                help="Seconds to wait when connecting to either server.",
            ),
        ]
    ):
        func = decorator(func)
    return func


@cli.command()
@click.argument("handler", required=False, envvar="OUTBOX_HANDLER")
@_option("--queue", "OUTBOX_QUEUE", default=None, help="The queue to consume.")
@consumer_server_options
@_option(
    "--consumer-name",
    "OUTBOX_CONSUMER_NAME",
    default=None,
    help="Name the inbox records ids under (default: the queue); consumers of "
    "consistent-hash shard queues share one.",
)
@_option(
    "--prefetch",
    "OUTBOX_PREFETCH",
    default=10,
    type=click.IntRange(min=1),
    help="Unacked messages the broker hands this consumer at once (1 for ordered queues).",
)
@_option(
    "--max-attempts",
    "OUTBOX_MAX_ATTEMPTS",
    default=5,
    type=click.IntRange(min=1),
    help="Failed handler calls after which a message is parked.",
)
@_option(
    "--retry-delay",
    "OUTBOX_RETRY_DELAY",
    default=0.1,
    type=float,
    help="Seconds before a failed message goes back to the queue; doubles per attempt.",
)
@_option(
    "--retry-delay-max",
    "OUTBOX_RETRY_DELAY_MAX",
    default=5.0,
    type=float,
    help="Longest retry delay (s).",
)
@_option(
    "--inbox-retention",
    "OUTBOX_INBOX_RETENTION",
    default="7d",
    help="Keep message ids this long (e.g. 7d, 12h); an older redelivery is applied again.",
)
@_option(
    "--bind",
    "OUTBOX_BIND",
    multiple=True,
    help="EXCHANGE:BINDING_KEY (repeatable): declare the queue (durable) and the exchange "
    "(durable topic) if missing, and bind them.",
)
@_option(
    "--backoff-initial",
    "OUTBOX_BACKOFF_INITIAL",
    default=0.2,
    type=float,
    help="First reconnect delay (s) after an outage; doubles up to --backoff-max.",
)
@_option("--backoff-max", "OUTBOX_BACKOFF_MAX", default=30.0, type=float, help="Longest delay.")
@_option(
    "--metrics-port",
    "OUTBOX_METRICS_PORT",
    default=0,
    type=click.IntRange(0, 65535),
    help="Serve /metrics, /healthz and /readyz on this port (0: off).",
)
@_option(
    "--metrics-address",
    "OUTBOX_METRICS_ADDRESS",
    default="0.0.0.0",
    help="Address the metrics and health endpoints listen on.",
)
@_option(
    "--log-level",
    "OUTBOX_LOG_LEVEL",
    default="info",
    type=click.Choice(["debug", "info", "warning", "error"]),
)
@_option("--log-format", "OUTBOX_LOG_FORMAT", default="text", type=click.Choice(["text", "json"]))
@click.option("--print-sql", is_flag=True, help="Print the inbox tables' SQL and exit.")
@known_errors
def consume(
    handler: str | None,
    queue: str | None,
    inbox_retention: str,
    bind: tuple[str, ...],
    metrics_port: int,
    metrics_address: str,
    log_level: str,
    log_format: str,
    print_sql: bool,
    **options: Any,
) -> None:
    """Consume QUEUE with exactly-once effects: HANDLER (MODULE:FUNCTION, or
    OUTBOX_HANDLER) is called as FUNCTION(conn, message) inside the transaction that
    records message.message_id in the inbox; a message already there is acked and
    skipped.  Runs until SIGTERM/SIGINT, then finishes the message in hand."""
    from outbox.inbox import loop as inbox
    from outbox.inbox.store import render_sql
    from outbox.ops.deadletters import parse_age

    if print_sql:
        click.echo(render_sql(options["inbox_table"]), nl=False)
        return
    if not handler:
        raise click.UsageError("give the handler as MODULE:FUNCTION (or set OUTBOX_HANDLER)")
    if not queue:
        raise click.UsageError("give the queue to consume: --queue (or OUTBOX_QUEUE)")
    try:
        settings = inbox.ConsumerSettings(
            queue=queue,
            inbox_retention=parse_age(inbox_retention),
            bindings=inbox.parse_bindings(bind),
            **options,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    configure(log_level, log_format)
    for noisy in ("amqp", "kombu"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    consumer = inbox.Inbox(inbox.load_handler(handler), settings)
    consumer.install_signal_handlers()
    endpoints = None
    try:
        consumer.start()
        if metrics_port:
            from outbox.inbox.metrics import ConsumerEndpoints

            try:
                endpoints = ConsumerEndpoints(
                    consumer, port=metrics_port, address=metrics_address
                ).start()
            except OSError as exc:
                raise click.UsageError(
                    f"cannot listen on {metrics_address}:{metrics_port}: {exc.strerror}"
                ) from exc
            emit(log, "consumer.endpoints", address=metrics_address, port=endpoints.port)
        stats = consumer.run()
    finally:
        if endpoints is not None:
            endpoints.close()
        consumer.close()
    summary = (
        f"consumer stopped: {stats.handled} handled, {stats.duplicates_skipped} duplicates "
        f"skipped, {stats.handler_failures} handler failures, {stats.parked} parked"
    )
    if log_format == "json":
        emit(
            log,
            "consumer.summary",
            handled=stats.handled,
            duplicates_skipped=stats.duplicates_skipped,
            handler_failures=stats.handler_failures,
            parked=stats.parked,
        )
    else:
        click.echo(summary, err=True)


@cli.group("parked")
def parked() -> None:
    """Messages `outbox consume` gave up on: list, retry after a fix, purge."""


def _parked_store(dsn: str, inbox_table: str, connect_timeout: float) -> Any:
    from outbox.inbox.store import ParkedStore

    return ParkedStore(dsn, inbox_table, connect_timeout=connect_timeout)


@parked.command("list")
@consumer_server_options
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.option("--limit", default=1000, show_default=True, help="Show at most this many.")
@known_errors
def parked_list(
    as_json: bool,
    limit: int,
    dsn: str,
    amqp_url: str,
    inbox_table: str,
    connect_timeout: float,
) -> None:
    """Parked messages, oldest first: message id, error, attempts, queue and origin."""
    from outbox.inbox.parked import as_dict, render

    parked_store = _parked_store(dsn, inbox_table, connect_timeout)
    try:
        rows = parked_store.entries(limit)
    finally:
        parked_store.close()
    if as_json:
        click.echo(json.dumps({"parked": [as_dict(r) for r in rows]}, indent=2, default=str))
    else:
        click.echo(render(rows))


@parked.command("retry")
@consumer_server_options
@click.option("--all", "everything", is_flag=True, help="Retry every parked message.")
@click.argument("message_ids", nargs=-1)
@known_errors
def parked_retry(
    everything: bool,
    message_ids: tuple[str, ...],
    dsn: str,
    amqp_url: str,
    inbox_table: str,
    connect_timeout: float,
) -> None:
    """Send parked messages back to the queue they came from (same message_id), once
    the handler or the data is fixed.  Exits 1 if a MESSAGE_ID is not parked."""
    from outbox.inbox.parked import retry

    if everything == bool(message_ids):
        raise click.UsageError("give either --all or one or more MESSAGE_IDs")
    ids = None if everything else list(message_ids)
    parked_store = _parked_store(dsn, inbox_table, connect_timeout)
    try:
        retried = retry(parked_store, amqp_url, ids, connect_timeout=connect_timeout)
    finally:
        parked_store.close()
    click.echo(f"{len(retried)} parked messages sent back to their queues")
    missing = sorted(set(ids or []) - set(retried))
    if missing:
        click.echo("not parked: " + " ".join(missing), err=True)
        sys.exit(int(ExitCode.FAILURE))


@parked.command("purge")
@consumer_server_options
@click.option("--all", "everything", is_flag=True, help="Delete every parked message.")
@click.option(
    "--older-than",
    envvar="OUTBOX_PARKED_MAX_AGE",
    show_envvar=True,
    default=None,
    help="Only those parked longer ago than this (e.g. 30d, 12h, 900s).",
)
@click.argument("message_ids", nargs=-1)
@known_errors
def parked_purge(
    everything: bool,
    older_than: str | None,
    message_ids: tuple[str, ...],
    dsn: str,
    amqp_url: str,
    inbox_table: str,
    connect_timeout: float,
) -> None:
    """Delete parked messages for good: --all, --older-than AGE, and/or MESSAGE_IDs.
    Their ids stay in the inbox until retention, so a late copy is still skipped."""
    from outbox.ops.deadletters import parse_age

    if everything and message_ids:
        raise click.UsageError("give --all or MESSAGE_IDs, not both")
    if not (everything or message_ids or older_than):
        raise click.UsageError("say what to purge: --all, --older-than AGE or MESSAGE_IDs")
    try:
        age = parse_age(older_than) if older_than else None
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    parked_store = _parked_store(dsn, inbox_table, connect_timeout)
    try:
        purged = parked_store.purge(list(message_ids) if message_ids else None, age)
    finally:
        parked_store.close()
    click.echo(f"{purged} parked messages purged")


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


@cli.command()
@own_servers_options
@click.option(
    "--rows",
    default=1000,
    show_default=True,
    type=click.IntRange(1, 10_000_000),
    help="Messages to send.",
)
@click.option(
    "--consume",
    is_flag=True,
    help="Instead: exactly-once effects with `outbox consume`, duplicates and a kill -9.",
)
@known_errors
def demo(dsn: str | None, amqp_url: str, rows: int, consume: bool) -> None:
    """Show the relay end to end: write rows, relay them, consume and check them."""
    from outbox.demo.relay import run_demo

    if consume:
        from outbox.demo.inbox import run_inbox_demo

        ok = run_inbox_demo(dsn=dsn, amqp_url=amqp_url, rows=rows, echo=click.echo)
        sys.exit(0 if ok else int(ExitCode.FAILURE))
    ok = run_demo(dsn=dsn, amqp_url=amqp_url, rows=rows, echo=click.echo)
    sys.exit(0 if ok else int(ExitCode.FAILURE))


@cli.command()
@own_servers_options
@click.option(
    "--rows",
    default=20_000,
    show_default=True,
    type=click.IntRange(1, 10_000_000),
    help="Messages per throughput run.",
)
@click.option(
    "--payload",
    default=1024,
    show_default=True,
    type=click.IntRange(1, 64 * 1024 * 1024),
    help="Payload bytes per message.",
)
@click.option(
    "--repeats",
    default=3,
    show_default=True,
    type=click.IntRange(1, 100),
    help="Runs per figure (bare/relay pairs, each scaling cell): medians.",
)
@click.option(
    "--relays", default="1,2,4", show_default=True, help="Relay counts for the scaling runs."
)
@click.option(
    "--batch-sizes",
    default="100,1000,5000",
    show_default=True,
    help="Batch sizes for the scaling runs.",
)
@click.option(
    "--window",
    default=1000,
    show_default=True,
    type=click.IntRange(1, 1_000_000),
    help="Bare publisher confirm window.",
)
@click.option(
    "--latency-rate",
    default=200.0,
    show_default=True,
    type=FiniteFloatRange(0, 100_000, min_open=True),
    help="Single-row commits per second.",
)
@click.option(
    "--latency-seconds",
    default=5.0,
    show_default=True,
    type=FiniteFloatRange(0, DAY, min_open=True),
    help="Length of the latency run.",
)
@click.option(
    "--idle-seconds",
    default=12.0,
    show_default=True,
    type=FiniteFloatRange(0, DAY, min_open=True),
    help="Length of the idle run.",
)
@click.option(
    "--burst-writers",
    default=8,
    show_default=True,
    type=click.IntRange(1, 256),
    help="Bursty load: writer threads.",
)
@click.option(
    "--burst-rows",
    default=250,
    show_default=True,
    type=click.IntRange(1, 1_000_000),
    help="Bursty load: rows per commit.",
)
@click.option(
    "--burst-pause",
    default=1.5,
    show_default=True,
    type=FiniteFloatRange(0, DAY),
    help="Bursty load: seconds between one writer's commits (jittered).",
)
@click.option(
    "--scaling/--no-scaling", default=True, show_default=True, help="Run the scaling grid."
)
@click.option(
    "--bursts/--no-bursts", default=True, show_default=True, help="Run the bursty-writers load."
)
@click.option(
    "--ordering/--no-ordering",
    default=True,
    show_default=True,
    help="Run the per-key ordering shapes (unordered, 1,000 keys, one hot key).",
)
@click.option(
    "--memory/--no-memory",
    default=True,
    show_default=True,
    help="Measure the relay's peak RSS draining large rows.",
)
@click.option(
    "--memory-backlogs",
    default=DEFAULT_MEMORY_BACKLOGS,
    show_default=True,
    help="Backlogs for the peak-RSS runs, each drained by one relay with default "
    "settings: COUNTxSIZE[+COUNTxSIZE…], comma-separated (e.g. 1000x8MiB+1x64MiB).",
)
@click.option(
    "--memory-only",
    is_flag=True,
    help="Instead: only the peak-RSS runs.",
)
@click.option(
    "--consume",
    is_flag=True,
    help="Instead: `outbox consume` (effects/s) against a bare kombu consumer (msg/s).",
)
@click.option(
    "--prefetch",
    default=10,
    show_default=True,
    type=click.IntRange(1, 65535),
    help="Prefetch of both consumers.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@known_errors
def bench(
    dsn: str | None,
    amqp_url: str,
    relays: str,
    batch_sizes: str,
    as_json: bool,
    consume: bool,
    prefetch: int,
    memory_backlogs: str,
    **options: Any,
) -> None:
    """Measure the relay against a bare pika publisher: msg/s, latency, idle cost
    (with --consume: the consumer's inbox against a bare kombu consumer)."""
    from outbox.bench.run import BenchOptions, render, run_bench

    echo: Callable[[str], None] = (lambda _line: None) if as_json else click.echo
    if consume:
        from outbox.bench import consume as bench_consume

        consume_report = bench_consume.run_consume_bench(
            bench_consume.ConsumeBenchOptions(
                amqp_url=urls.parse_amqp_urls(amqp_url)[0].text,
                dsn=dsn,
                rows=options["rows"],
                payload=options["payload"],
                repeats=options["repeats"],
                prefetch=prefetch,
                window=options["window"],
            ),
            echo,
        )
        click.echo(
            json.dumps(consume_report, indent=2)
            if as_json
            else bench_consume.render(consume_report)
        )
        sys.exit(0 if consume_report["every_message_once"] else int(ExitCode.FAILURE))

    def numbers(text: str, option: str, most: int) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(",") if v.strip())
        except ValueError as exc:
            raise click.UsageError(f"{option}: not a list of numbers: {text!r}") from exc
        if not values or min(values) < 1 or max(values) > most:
            raise click.UsageError(f"{option}: not a list of numbers from 1 to {most}: {text!r}")
        return values

    from outbox.bench.memory import parse_backlogs

    try:
        backlogs = parse_backlogs(memory_backlogs)
    except ValueError as exc:
        raise click.UsageError(f"--memory-backlogs: {exc}") from exc
    if not backlogs:
        raise click.UsageError("--memory-backlogs: no backlog given")
    bench_options = BenchOptions(
        # The bare publisher is plain pika: it takes one URL, so all take the first.
        amqp_url=urls.parse_amqp_urls(amqp_url)[0].text,
        dsn=dsn,
        relays=numbers(relays, "--relays", 64),
        batch_sizes=numbers(batch_sizes, "--batch-sizes", int(LIMITS["batch_size"].high)),
        memory_backlogs=backlogs,
        **options,
    )
    report = run_bench(bench_options, echo)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(render(report))
    sys.exit(0 if report["every_row_arrived"] else int(ExitCode.FAILURE))


def main(argv: Sequence[str] | None = None, prog_name: str = "outbox") -> None:
    """Run the command; every error leaves as one line (or JSON object) and its exit code."""
    args = list(argv) if argv is not None else sys.argv[1:]
    try:
        code = cli.main(args=args, prog_name=prog_name, standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        ctx = exc.ctx if isinstance(exc, click.UsageError) else None
        hint = f"`{ctx.command_path if ctx else prog_name} --help` lists the options and ranges"
        as_json = _wants_json(ctx, args)
        report_error(exc.format_message(), hint, code=exc.exit_code, as_json=as_json)
        sys.exit(exc.exit_code)
    except click.Abort:
        sys.exit(int(ExitCode.FAILURE))
    except BrokenPipeError:
        sys.exit(int(ExitCode.FAILURE))  # stdout closed early (`outbox … | head`)
    except Exception as exc:
        # A bug: keep the traceback for the report, but never a password in it.
        trace = "".join(traceback.format_exception(exc))
        as_json = _wants_json(None, args)
        if not as_json:
            click.echo(redaction.redact(trace.rstrip()), err=True)
        report_error(
            f"unexpected {type(exc).__name__}: {exc}",
            "this is a bug in outbox-relay: please report it with the lines above",
            code=int(ExitCode.FAILURE),
            as_json=as_json,
            **({"exception": redaction.redact(trace)} if as_json else {}),
        )
        sys.exit(int(ExitCode.FAILURE))
    sys.exit(code if isinstance(code, int) else 0)
