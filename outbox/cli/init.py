"""``outbox init``: create or upgrade the outbox schema, online (``outbox.ops.upgrade``)."""

from __future__ import annotations

import logging
from typing import Any

import click

from outbox import redaction
from outbox.cli.common import (
    known_errors,
    operator_session_options,
    server_options,
    settings_from,
)
from outbox.db import migrate
from outbox.events import json_line
from outbox.ops.upgrade import Upgrade


@click.command()
@server_options
@operator_session_options
@click.option("--print-sql", is_flag=True, help="Print the schema instead of applying it.")
@known_errors
def init(print_sql: bool, **options: Any) -> None:
    """Create or upgrade the outbox schema (idempotent, safe to run concurrently, online:
    the application's INSERTs never wait long behind it)."""
    settings = settings_from(**options)
    if print_sql:
        click.echo(migrate.render_sql(settings.table), nl=False)
        return

    def say(line: str) -> None:
        if options.get("log_format") == "json":
            click.echo(
                json_line(logging.WARNING, "outbox.init", "init.progress", message=line), err=True
            )
        else:
            click.echo(f"outbox init: {redaction.redact(line)}", err=True)

    before, after = Upgrade(settings, say=say).run()
    if before == after:
        click.echo(f"schema of {settings.table!r} is up to date (version {after})")
    else:
        click.echo(f"schema of {settings.table!r} migrated from {before or 'nothing'} to {after}")
