"""Versioned, idempotent schema migrations (``outbox init``).

Migrations are the files ``schema/NNNN_*.sql``, applied in order inside one
transaction that first takes an advisory lock, so several ``outbox init`` (or
several relays' deploy hooks) running at once apply each file exactly once.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from importlib import resources

import psycopg
from psycopg import sql
from psycopg.rows import tuple_row

from outbox.db import privileges
from outbox.errors import MissingPrivileges, SchemaNotReady, SchemaTooNew
from outbox.tables import table_identifiers

# Advisory-lock class of migrations; distinct from gid.LOCK_CLASS (relay liveness).
MIGRATION_LOCK_CLASS = 0x6F6279

_FILE = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")


@dataclasses.dataclass(frozen=True)
class Migration:
    version: int
    name: str
    text: str


def migrations() -> list[Migration]:
    folder = resources.files("outbox.db").joinpath("schema")
    found = []
    for entry in folder.iterdir():
        match = _FILE.match(entry.name)
        if match:
            found.append(Migration(int(match.group(1)), entry.name, entry.read_text("utf-8")))
    return sorted(found, key=lambda m: m.version)


LATEST_VERSION = migrations()[-1].version


def _version_table_sql(table: str) -> sql.Composed:
    return sql.SQL(
        "CREATE TABLE IF NOT EXISTS {schema_version} ("
        " version integer PRIMARY KEY,"
        " name text NOT NULL,"
        " applied_at timestamptz NOT NULL DEFAULT now())"
    ).format(schema_version=table_identifiers(table)["schema_version"])


def _migration_sql(table: str, migration: Migration) -> sql.Composed:
    return sql.SQL(migration.text).format(**table_identifiers(table))


def render_sql(table: str) -> str:
    """The whole schema as one script, for teams that run their own migrations."""
    parts = [f"-- outbox schema for table {table!r}, version {LATEST_VERSION}", "BEGIN;"]
    parts.append(_version_table_sql(table).as_string(None) + ";")
    for migration in migrations():
        parts.append(f"-- {migration.name}")
        parts.append(_migration_sql(table, migration).as_string(None))
        parts.append(
            sql.SQL("INSERT INTO {} (version, name) VALUES ({}, {}) ON CONFLICT DO NOTHING;")
            .format(
                table_identifiers(table)["schema_version"],
                sql.Literal(migration.version),
                sql.Literal(migration.name),
            )
            .as_string(None)
        )
    parts.append("COMMIT;")
    return "\n".join(parts) + "\n"


def current_version(conn: psycopg.Connection[object], table: str) -> int | None:
    """The applied schema version, or None when the outbox was never initialised."""
    cur = conn.cursor(row_factory=tuple_row)
    row = cur.execute("SELECT to_regclass(%s) IS NOT NULL", [f"{table}_schema_version"]).fetchone()
    if not row or not row[0]:
        return None
    version = cur.execute(
        sql.SQL("SELECT max(version) FROM {}").format(table_identifiers(table)["schema_version"])
    ).fetchone()
    return int(version[0]) if version and version[0] is not None else None


def require_current(version: int | None, table: str) -> None:
    """Raise unless ``version`` is the one this code was written for."""
    if version is None:
        raise SchemaNotReady(
            f"the outbox table {table!r} has not been created in this database",
            "run `outbox init` (or apply `outbox init --print-sql`)",
        )
    if version < LATEST_VERSION:
        raise SchemaNotReady(
            f"the outbox schema is at version {version}, this relay needs {LATEST_VERSION}",
            "run `outbox init` to upgrade it",
        )
    refuse_newer(version, table)


def refuse_newer(version: int | None, table: str) -> None:
    """A newer outbox-relay migrated this schema: this one cannot know what changed."""
    if version is not None and version > LATEST_VERSION:
        raise SchemaTooNew(
            f"the schema of {table!r} is at version {version}, newer than this outbox-relay "
            f"knows (version {LATEST_VERSION})",
            "run the outbox-relay release that migrated it, or a newer one; "
            "never downgrade a schema by hand",
        )


def migrate(conn: psycopg.Connection[object], table: str) -> tuple[int | None, int]:
    """Apply the missing migrations; returns (version before, version after).

    Refuses (``SchemaTooNew``) a schema newer than this code, changing nothing.
    An up-to-date schema is left alone, so any role that may read the version
    table may run ``outbox init``; changing the schema takes the right to create
    tables in the schema and ownership of the existing ones (``MissingPrivileges``
    names them otherwise).
    """
    try:
        return _migrate(conn, table)
    except psycopg.errors.InsufficientPrivilege as exc:
        text = str(exc).strip().splitlines()[0]
        raise MissingPrivileges(
            f"PostgreSQL refused the schema change: {text}",
            "run `outbox init` as the owner of the outbox tables (README.md, 'Privileges')",
        ) from exc


def _migrate(conn: psycopg.Connection[object], table: str) -> tuple[int | None, int]:
    with conn.transaction():
        conn.execute(
            "SELECT pg_advisory_xact_lock(%s, %s)",
            [MIGRATION_LOCK_CLASS, zlib.crc32(table.encode()) & 0x7FFFFFFF],
        )
        before = current_version(conn, table)
        refuse_newer(before, table)
        if before is not None and before >= LATEST_VERSION:
            return before, LATEST_VERSION
        _check_may_migrate(conn, table)
        conn.execute(_version_table_sql(table))
        for migration in migrations():
            if before is not None and migration.version <= before:
                continue
            conn.execute(_migration_sql(table, migration))
            conn.execute(
                sql.SQL("INSERT INTO {} (version, name) VALUES (%s, %s)").format(
                    table_identifiers(table)["schema_version"]
                ),
                [migration.version, migration.name],
            )
    return before, LATEST_VERSION


def _check_may_migrate(conn: psycopg.Connection[object], table: str) -> None:
    """Raise ``MissingPrivileges`` unless this role may create the tables in its
    schema and owns (or is a member of the owner of) those that exist."""
    names = [
        privileges.table_name(table, role)
        for role in (
            privileges.OUTBOX,
            privileges.RELAYS,
            privileges.DEAD_LETTERS,
            privileges.SCHEMA_VERSION,
        )
    ]
    cur = conn.cursor(row_factory=tuple_row)
    row = cur.execute(
        "SELECT current_user, current_schema(),"
        " coalesce(has_schema_privilege(current_schema(), 'CREATE'), false),"
        " array(SELECT c.relname::text FROM pg_class c"
        "       WHERE c.oid = ANY(array(SELECT to_regclass(n) FROM unnest(%s::text[]) n))"
        "         AND NOT pg_has_role(c.relowner, 'USAGE') ORDER BY 1)",
        [names],
    ).fetchone()
    assert row is not None
    role, schema, may_create, not_owned = row
    if not may_create:
        raise MissingPrivileges(
            f"the database role {role!r} may not create tables in schema {schema!r}",
            f"as its owner, run: GRANT CREATE ON SCHEMA {schema} TO "
            f"{privileges.quote_role(role)}; or run `outbox init` as the tables' owner",
        )
    if not_owned:
        raise MissingPrivileges(
            f"the database role {role!r} does not own {', '.join(not_owned)}: "
            "upgrading the schema alters them",
            "run `outbox init` as their owner",
        )
