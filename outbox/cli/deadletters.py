"""``outbox dead-letters``: list, retry and purge rows that could not be published."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import click

from outbox.cli.common import (
    ORDERING_KEY_OPTION,
    known_errors,
    operator_session_options,
    server_options,
    settings_from,
)
from outbox.cli.quarantine import fail_if_missing, list_command, purge_age, purge_options
from outbox.db.deadletters import DeadLetterStore
from outbox.ops.deadletters import DEAD_LETTERS, open_store
from outbox.ops.quarantine import opened


@click.group("dead-letters")
def dead_letters() -> None:
    """Rows that can never be published as they are: list, retry after a fix, purge."""


def _dead_letter_store(options: dict[str, Any]) -> AbstractContextManager[DeadLetterStore]:
    """The store the command's options name (its log options are not the store's)."""
    named = {k: v for k, v in options.items() if k not in ("log_level", "log_format")}
    return opened(lambda: open_store(settings_from(**named)))


def _message_ids(texts: Sequence[str], ordering_keys: Sequence[str] = ()) -> Any:
    from outbox.ops.deadletters import parse_ids

    try:
        return parse_ids(texts, ordering_keys)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


list_command(
    dead_letters,
    server_options,
    _dead_letter_store,
    DEAD_LETTERS,
    "Dead letters, oldest first: message id, reason, when, and where it was going.",
)


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
    with _dead_letter_store(options) as store:
        moved = store.retry(
            everything=everything,
            message_ids=selection.message_ids,
            row_ids=selection.row_ids,
            ordering_keys=selection.ordering_keys,
        )
    click.echo(DEAD_LETTERS.retry_done(len(moved)))
    fail_if_missing(DEAD_LETTERS.not_found, selection.not_found(moved))


@dead_letters.command("purge")
@server_options
@operator_session_options
@purge_options(noun="dead letter", envvar="OUTBOX_DEAD_LETTERS_MAX_AGE", which="that failed")
@ORDERING_KEY_OPTION
@click.argument("message_ids", nargs=-1)
@known_errors
def dead_letters_purge(
    everything: bool,
    older_than: str | None,
    ordering_keys: tuple[str, ...],
    message_ids: tuple[str, ...],
    **options: Any,
) -> None:
    """Delete dead letters for good: --all, --older-than AGE, and/or MESSAGE_IDs (every
    row carrying the id), row ids or --ordering-key KEY (every dead letter of the key).

    Exits 1 if a given id was not purged (not a dead letter, or younger than
    --older-than).
    """
    named = bool(message_ids or ordering_keys)
    age = purge_age(everything, named, older_than, ("MESSAGE_IDs", "--ordering-key"))
    selection = _message_ids(message_ids, ordering_keys)
    with _dead_letter_store(options) as store:
        purged = store.purge(
            everything=not named,
            message_ids=selection.message_ids,
            row_ids=selection.row_ids,
            ordering_keys=selection.ordering_keys,
            older_than=age,
        )
    click.echo(DEAD_LETTERS.purge_done(len(purged)))
    why = DEAD_LETTERS.not_found + ("" if age is None else ", or younger than that")
    fail_if_missing(why, selection.not_found(purged))
