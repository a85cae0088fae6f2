"""``outbox parked``: list, retry and purge messages the consumer gave up on."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import click

from outbox.cli.common import (
    consumer_server_options,
    env_option,
    known_errors,
    operator_session_options,
)
from outbox.cli.options import limited
from outbox.cli.quarantine import fail_if_missing, list_command, purge_age, purge_options
from outbox.config import Settings
from outbox.db.inbox import ParkedStore
from outbox.db.session import OperatorBounds
from outbox.ops.parked import PARKED
from outbox.ops.quarantine import opened


@click.group("parked")
def parked() -> None:
    """Messages `outbox consume` gave up on: list, retry after a fix, purge."""


def _parked_store(options: dict[str, Any]) -> AbstractContextManager[ParkedStore]:
    """The store the command's options name."""
    bounds = OperatorBounds(
        options["connect_timeout"], options["statement_timeout"], options["lock_timeout"]
    )
    return opened(lambda: ParkedStore(options["dsn"], options["inbox_table"], bounds))


list_command(
    parked,
    consumer_server_options,
    _parked_store,
    PARKED,
    "Parked messages, oldest first: message id, error, attempts, queue and origin.",
)


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
    **options: Any,
) -> None:
    """Send parked messages back to the queue they came from (same message_id), once
    the handler or the data is fixed.  A message the broker does not take (its queue
    is gone) stays parked, named with why on stderr, and the others are sent.  Exits
    1 if a message stayed parked so, or a MESSAGE_ID is not parked."""
    # Not at the top: the publisher imports kombu, which imports Django when it is
    # installed; only a retry needs it.
    from outbox.inbox.parked import NotSent, retry

    if everything == bool(message_ids):
        raise click.UsageError("give either --all or one or more MESSAGE_IDs")
    ids = None if everything else list(message_ids)
    not_sent: list[NotSent] = []
    with _parked_store(options) as store:
        retried = retry(
            store,
            options["amqp_url"],
            ids,
            connect_timeout=options["connect_timeout"],
            confirm_timeout=publish_timeout,
            max_bytes=batch_max_bytes,
            not_sent=not_sent,
        )
    click.echo(PARKED.retry_done(len(retried)))
    for message_id, why in not_sent:
        click.echo(f"not retried, still parked: {message_id!r}: {why}", err=True)
    missing = sorted(set(ids or []) - set(retried) - {n.message_id for n in not_sent})
    fail_if_missing(PARKED.not_found, missing, failed=bool(not_sent))


@parked.command("purge")
@consumer_server_options
@operator_session_options
@purge_options(noun="parked message", envvar="OUTBOX_PARKED_MAX_AGE", which="parked")
@click.argument("message_ids", nargs=-1)
@known_errors
def parked_purge(
    everything: bool,
    older_than: str | None,
    message_ids: tuple[str, ...],
    **options: Any,
) -> None:
    """Delete parked messages for good: --all, --older-than AGE, and/or MESSAGE_IDs.
    Their ids stay in the inbox until retention, so a late copy is still skipped."""
    age = purge_age(everything, bool(message_ids), older_than, ("MESSAGE_IDs",))
    with _parked_store(options) as store:
        purged = store.purge(list(message_ids) if message_ids else None, age)
    click.echo(PARKED.purge_done(purged))
