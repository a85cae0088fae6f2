"""``outbox parked``: list, retry and purge messages the consumer gave up on."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from outbox.cli.common import (
    consumer_server_options,
    env_option,
    known_errors,
    operator_session_options,
)
from outbox.cli.options import LIST_LIMIT, Age, limited
from outbox.config import Settings
from outbox.errors import ExitCode


@click.group("parked")
def parked() -> None:
    """Messages `outbox consume` gave up on: list, retry after a fix, purge."""


def _parked_store(
    dsn: str,
    inbox_table: str,
    connect_timeout: float,
    statement_timeout: float,
    lock_timeout: float,
) -> Any:
    from outbox.inbox.store import ParkedStore

    return ParkedStore(
        dsn,
        inbox_table,
        connect_timeout=connect_timeout,
        statement_timeout=statement_timeout,
        lock_timeout=lock_timeout,
    )


@parked.command("list")
@consumer_server_options
@operator_session_options
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.option(
    "--limit",
    default=1000,
    show_default=True,
    type=LIST_LIMIT,
    help="Show at most this many.",
)
@known_errors
def parked_list(
    as_json: bool,
    limit: int,
    dsn: str,
    amqp_url: str,
    inbox_table: str,
    connect_timeout: float,
    statement_timeout: float,
    lock_timeout: float,
) -> None:
    """Parked messages, oldest first: message id, error, attempts, queue and origin."""
    from outbox.inbox.parked import as_dict, render

    parked_store = _parked_store(dsn, inbox_table, connect_timeout, statement_timeout, lock_timeout)
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
@operator_session_options
@click.option("--all", "everything", is_flag=True, help="Retry every parked message.")
@env_option(
    "--publish-timeout",
    "OUTBOX_PUBLISH_TIMEOUT",
    default=Settings.publish_timeout,
    type=limited("publish_timeout"),
    help="Seconds to wait for each message's confirm; then exit 6 (the message stays "
    "listed: retrying again is safe, the inbox skips a copy already applied).",
)
@env_option(
    "--batch-max-bytes",
    "OUTBOX_BATCH_MAX_BYTES",
    default=Settings.batch_max_bytes,
    type=limited("batch_max_bytes"),
    help="Most bytes of parked messages (bodies, headers, properties) held in memory at "
    "once (a larger message goes alone).",
)
@click.argument("message_ids", nargs=-1)
@known_errors
def parked_retry(
    everything: bool,
    publish_timeout: float,
    batch_max_bytes: int,
    message_ids: tuple[str, ...],
    dsn: str,
    amqp_url: str,
    inbox_table: str,
    connect_timeout: float,
    statement_timeout: float,
    lock_timeout: float,
) -> None:
    """Send parked messages back to the queue they came from (same message_id), once
    the handler or the data is fixed.  A message the broker does not take (its queue
    is gone) stays parked, named with why on stderr, and the others are sent.  Exits
    1 if a message stayed parked so, or a MESSAGE_ID is not parked."""
    from outbox.inbox.parked import NotSent, retry

    if everything == bool(message_ids):
        raise click.UsageError("give either --all or one or more MESSAGE_IDs")
    ids = None if everything else list(message_ids)
    not_sent: list[NotSent] = []
    parked_store = _parked_store(dsn, inbox_table, connect_timeout, statement_timeout, lock_timeout)
    try:
        retried = retry(
            parked_store,
            amqp_url,
            ids,
            connect_timeout=connect_timeout,
            confirm_timeout=publish_timeout,
            max_bytes=batch_max_bytes,
            not_sent=not_sent,
        )
    finally:
        parked_store.close()
    click.echo(f"{len(retried)} parked messages sent back to their queues")
    for message_id, why in not_sent:
        click.echo(f"not retried, still parked: {message_id!r}: {why}", err=True)
    missing = sorted(set(ids or []) - set(retried) - {n.message_id for n in not_sent})
    if missing:
        click.echo("not parked: " + " ".join(missing), err=True)
    if not_sent or missing:
        sys.exit(int(ExitCode.FAILURE))


@parked.command("purge")
@consumer_server_options
@operator_session_options
@click.option("--all", "everything", is_flag=True, help="Delete every parked message.")
@click.option(
    "--older-than",
    envvar="OUTBOX_PARKED_MAX_AGE",
    show_envvar=True,
    default=None,
    type=Age(),
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
    statement_timeout: float,
    lock_timeout: float,
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
    parked_store = _parked_store(dsn, inbox_table, connect_timeout, statement_timeout, lock_timeout)
    try:
        purged = parked_store.purge(list(message_ids) if message_ids else None, age)
    finally:
        parked_store.close()
    click.echo(f"{purged} parked messages purged")
