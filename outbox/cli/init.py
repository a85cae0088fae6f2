"""``outbox init``: create or upgrade the outbox schema."""

from __future__ import annotations

from typing import Any

import click

from outbox.cli.common import (
    known_errors,
    server_options,
    settings_from,
)
from outbox.db import migrate, session


@click.command()
@server_options
@click.option("--print-sql", is_flag=True, help="Print the schema instead of applying it.")
@known_errors
def init(print_sql: bool, **options: Any) -> None:
    """Create or upgrade the outbox schema (idempotent, safe to run concurrently)."""
    settings = settings_from(**options)
    if print_sql:
        click.echo(migrate.render_sql(settings.table), nl=False)
        return
    conn = session.connect(settings.dsn, application_name="outbox-init")
    try:
        before, after = migrate.migrate(conn, settings.table)
    finally:
        conn.close()
    if before == after:
        click.echo(f"schema of {settings.table!r} is up to date (version {after})")
    else:
        click.echo(f"schema of {settings.table!r} migrated from {before or 'nothing'} to {after}")
