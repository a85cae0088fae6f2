"""The options and output ``outbox dead-letters`` and ``outbox parked`` share: one
quarantine (``outbox.ops.quarantine``), one way to list, retry and purge it."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import click

from outbox.cli.common import apply, known_errors, operator_session_options
from outbox.cli.options import LIST_LIMIT, Age
from outbox.errors import ExitCode

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from outbox.ops.quarantine import Kind, Store

F = TypeVar("F", bound=Callable[..., Any])

Row = dict[str, Any]


def list_options(func: F) -> F:
    """``list``'s own options: ``--json`` and ``--limit``."""
    return apply(
        func,
        [
            click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout."),
            click.option(
                "--limit",
                default=1000,
                show_default=True,
                type=LIST_LIMIT,
                help="Show at most this many.",
            ),
        ],
    )


def purge_options(*, noun: str, envvar: str, which: str) -> Callable[[F], F]:
    """``purge``'s ``--all`` and ``--older-than`` (its environment variable ``envvar``;
    ``which``: the entries it keeps, "that failed" or "parked", longer ago)."""

    def decorate(func: F) -> F:
        return apply(
            func,
            [
                click.option("--all", "everything", is_flag=True, help=f"Delete every {noun}."),
                click.option(
                    "--older-than",
                    envvar=envvar,
                    show_envvar=True,
                    default=None,
                    type=Age(),
                    help=f"Only those {which} longer ago than this (e.g. 30d, 12h, 900s).",
                ),
            ],
        )

    return decorate


def list_command(
    group: click.Group,
    server_options: Callable[[Callable[..., Any]], Callable[..., Any]],
    store: Callable[[dict[str, Any]], AbstractContextManager[Store]],
    kind: Kind,
    help: str,
) -> None:
    """``list``, in ``group``: the oldest entries of ``store`` (opened from the
    command's options), as ``kind`` lists them."""

    @group.command("list", help=help)
    @server_options
    @operator_session_options
    @list_options
    @known_errors
    def list_entries(as_json: bool, limit: int, **options: Any) -> None:
        from outbox.ops.quarantine import listed

        with store(options) as opened:
            rows = opened.entries(limit)
        click.echo(listed(kind, rows, as_json=as_json))


def purge_age(
    everything: bool, named: bool, older_than: str | None, names: Sequence[str]
) -> float | None:
    """The ``--older-than`` of a purge in seconds, after checking the purge says what
    to delete (a usage error if not)."""
    from outbox.ops.deadletters import parse_age
    from outbox.ops.quarantine import purge_refusal

    refusal = purge_refusal(everything, named, older_than, names)
    if refusal:
        raise click.UsageError(refusal)
    try:
        return parse_age(older_than) if older_than else None
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


def fail_if_missing(why: str, missing: Sequence[str], *, failed: bool = False) -> None:
    """Exit 1 after naming, on stderr, what a retry or purge did not find (or if it
    ``failed`` otherwise, and said so)."""
    if missing:
        click.echo(f"{why}: " + " ".join(missing), err=True)
    if missing or failed:
        sys.exit(int(ExitCode.FAILURE))
