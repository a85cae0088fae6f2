"""``outbox dead-letters``: list, retry and purge rows that could not be published."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

import click

from outbox.cli.common import (
    ORDERING_KEY_OPTION,
    known_errors,
    operator_session_options,
    server_options,
    settings_from,
)
from outbox.cli.options import LIST_LIMIT, Age
from outbox.db import deadletters
from outbox.errors import ExitCode


@click.group("dead-letters")
def dead_letters() -> None:
    """Rows that can never be published as they are: list, retry after a fix, purge."""


def _dead_letter_store(options: dict[str, Any]) -> deadletters.DeadLetterStore:
    from outbox.ops.deadletters import open_store

    return open_store(settings_from(**options))


def _message_ids(texts: Sequence[str], ordering_keys: Sequence[str] = ()) -> Any:
    from outbox.ops.deadletters import parse_ids

    try:
        return parse_ids(texts, ordering_keys)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


@dead_letters.command("list")
@server_options
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


@dead_letters.command("retry")
@server_options
@operator_session_options
@click.option("--all", "everything", is_flag=True, help="Retry every dead letter.")
@ORDERING_KEY_OPTION
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
@operator_session_options
@click.option("--all", "everything", is_flag=True, help="Delete every dead letter.")
@click.option(
    "--older-than",
    envvar="OUTBOX_DEAD_LETTERS_MAX_AGE",
    show_envvar=True,
    default=None,
    type=Age(),
    help="Only those that failed longer ago than this (e.g. 30d, 12h, 900s).",
)
@ORDERING_KEY_OPTION
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
