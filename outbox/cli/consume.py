"""``outbox consume``: exactly-once effects from a queue."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from typing import Any

import click

from outbox.cli.common import (
    backoff_initial_option,
    backoff_max_option,
    consumer_server_options,
    env_option,
    known_errors,
    log_format_option,
    log_level_option,
    metrics_address_option,
    metrics_port_option,
)
from outbox.cli.options import Age, FiniteFloatRange, QueueName, age_text
from outbox.events import configure, emit
from outbox.inbox.settings import MAX_PREFETCH, MAX_RETRY_DELAY, ConsumerSettings, parse_bindings

log = logging.getLogger("outbox.inbox")


@click.command()
@click.argument("handler", required=False, envvar="OUTBOX_HANDLER")
@env_option(
    "--queue",
    "OUTBOX_QUEUE",
    default=None,
    type=QueueName(declared=False),
    help="The queue to consume.",
)
@consumer_server_options
@env_option(
    "--consumer-name",
    "OUTBOX_CONSUMER_NAME",
    default=ConsumerSettings.consumer_name,
    type=QueueName("consumer name", declared=False),
    help="Name the inbox records ids under (default: the queue); consumers of "
    "consistent-hash shard queues share one.",
)
@env_option(
    "--prefetch",
    "OUTBOX_PREFETCH",
    default=ConsumerSettings.prefetch,
    type=click.IntRange(1, MAX_PREFETCH),
    help="Unacked messages the broker hands this consumer at once; a batch takes at most "
    "half, so the next one arrives while a batch commits (1 for ordered queues).",
)
@env_option(
    "--max-attempts",
    "OUTBOX_MAX_ATTEMPTS",
    default=ConsumerSettings.max_attempts,
    type=click.IntRange(1, 1_000_000),
    help="Failed handler calls after which a message is parked.",
)
@env_option(
    "--retry-delay",
    "OUTBOX_RETRY_DELAY",
    default=ConsumerSettings.retry_delay,
    type=FiniteFloatRange(0, MAX_RETRY_DELAY),
    help="Seconds a failed message waits (in hand, the others going on) before its next "
    "attempt; doubles per attempt.",
)
@env_option(
    "--retry-delay-max",
    "OUTBOX_RETRY_DELAY_MAX",
    default=ConsumerSettings.retry_delay_max,
    type=FiniteFloatRange(0, MAX_RETRY_DELAY),
    help="Longest retry delay (s), at least --retry-delay.",
)
@env_option(
    "--delivery-limit",
    "OUTBOX_DELIVERY_LIMIT",
    default=ConsumerSettings.delivery_limit,
    type=click.IntRange(0, None),
    help="The queue's delivery limit when a policy sets it (an x-delivery-limit argument "
    "is read from the queue).",
)
@env_option(
    "--inbox-retention",
    "OUTBOX_INBOX_RETENTION",
    default=age_text(ConsumerSettings.inbox_retention),
    type=Age(),
    help="Keep message ids this long (e.g. 7d, 12h); an older redelivery is applied again.",
)
@env_option(
    "--bind",
    "OUTBOX_BIND",
    multiple=True,
    help="EXCHANGE:BINDING_KEY (repeatable): declare the queue (durable) and the exchange "
    "(durable topic) if missing, and bind them.",
)
@backoff_initial_option
@backoff_max_option
@metrics_port_option
@metrics_address_option
@log_level_option
@log_format_option
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
    records message.message_id in the inbox (awaited, with a psycopg AsyncConnection,
    if it is an async def); a message already there is acked and skipped.  Runs until
    SIGTERM/SIGINT, then finishes the message in hand."""
    from outbox.db.inbox import render_sql
    from outbox.inbox import aio
    from outbox.inbox.handlers import load_handler
    from outbox.inbox.process import Inbox, serve
    from outbox.ops.deadletters import parse_age

    if print_sql:
        click.echo(render_sql(options["inbox_table"]), nl=False)
        return
    if not handler:
        raise click.UsageError("give the handler as MODULE:FUNCTION (or set OUTBOX_HANDLER)")
    if not queue:
        raise click.UsageError("give the queue to consume: --queue (or OUTBOX_QUEUE)")
    try:
        settings = ConsumerSettings(
            queue=queue,
            inbox_retention=parse_age(inbox_retention),
            bindings=parse_bindings(bind),
            **options,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    configure(log_level, log_format)
    for noisy in ("amqp", "kombu"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    loaded = load_handler(handler)
    # An async def handler: the same consumer, its statements and handler awaited
    # on an event loop of this process (outbox.inbox.aio).
    loop = asyncio.new_event_loop() if aio.is_async(loaded) else None
    consumer = Inbox(loaded, settings) if loop is None else aio.async_inbox(loaded, settings, loop)
    consumer.install_signal_handlers()
    try:
        stats = serve(
            consumer,
            metrics_port=metrics_port,
            metrics_address=metrics_address,
            run=None if loop is None else lambda: loop.run_until_complete(aio.run_async(consumer)),
        )
    finally:
        if loop is not None:
            loop.close()
    if log_format != "json":  # the consumer.summary event, logged, has it all for JSON
        click.echo(
            f"consumer stopped: {stats.handled} handled, {stats.duplicates_skipped} duplicates "
            f"skipped, {stats.handler_failures} handler failures, {stats.parked} parked",
            err=True,
        )
    leave_handlers_threads()


def leave_handlers_threads() -> None:
    """Exit now if a handler left a thread that is not a daemon: Python's exit would
    wait for it for ever, and the consumer, done and disconnected, would never end
    on SIGTERM (an orchestrator then kills it).  Said in the log, then exit 0."""
    left = [
        t.name
        for t in threading.enumerate()
        if t is not threading.main_thread() and not t.daemon and t.is_alive()
    ]
    if not left:
        return
    emit(log, "consumer.threads_left", logging.WARNING, threads=", ".join(left))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
