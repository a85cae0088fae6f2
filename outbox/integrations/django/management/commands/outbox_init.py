"""``manage.py outbox_init``: ``outbox init`` on a Django database."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

import psycopg
from django.core.management.base import BaseCommand, CommandError
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections

from outbox.db import migrate
from outbox.errors import OutboxError
from outbox.integrations.django import migrate_schema, outbox_table


class Command(BaseCommand):
    help = (
        "Create or upgrade the outbox schema (what `outbox init` does; idempotent, "
        "safe to run concurrently)."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--database",
            default=DEFAULT_DB_ALIAS,
            help="Django database alias (default: %(default)s).",
        )
        parser.add_argument(
            "--table", help="Outbox table (default: settings.OUTBOX_TABLE, else 'outbox')."
        )
        parser.add_argument(
            "--print-sql",
            action="store_true",
            help="Print the schema as one SQL script instead of applying it.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        table = options["table"] or outbox_table()
        if options["print_sql"]:
            self.stdout.write(migrate.render_sql(table), ending="")
            return
        alias = options["database"]
        try:
            before, after = migrate_schema(connections[alias], table)
        except OutboxError as exc:
            raise CommandError(
                f"{exc.message}\n  hint: {exc.hint}" if exc.hint else exc.message
            ) from exc
        except (DatabaseError, psycopg.Error) as exc:
            # Django's errors (connecting) and psycopg's (the migration runs on psycopg).
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise CommandError(f"database {alias!r}: {reason}") from exc
        if before == after:
            self.stdout.write(f"schema of {table!r} is up to date (version {after})")
        else:
            self.stdout.write(f"schema of {table!r} migrated from {before or 'nothing'} to {after}")
