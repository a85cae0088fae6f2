"""``outbox demo``: the whole path on local servers."""

from __future__ import annotations

import sys

import click

from outbox.cli.common import (
    known_errors,
    own_servers_options,
)
from outbox.errors import ExitCode


@click.command()
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
