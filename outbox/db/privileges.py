"""The table privileges each command needs, and the GRANTs that supply them.

Pure: ``store.check_privileges`` asks PostgreSQL (``has_table_privilege``) about
the pairs listed here and raises ``MissingPrivileges`` with the exact GRANT
statements, instead of a traceback half-way through a batch.  docs/reference/privileges.md
shows the same lists.

Why each one: the claim is ``DELETE … WHERE id IN (SELECT … FOR UPDATE SKIP
LOCKED) RETURNING …`` (SELECT, UPDATE for the row lock, DELETE); dead letters are
written with ``INSERT … ON CONFLICT DO UPDATE`` that reads ``attempts`` (INSERT,
UPDATE, SELECT); the registry is inserted, heartbeated and pruned; ``retry`` puts
rows back with ``INSERT … ON CONFLICT DO NOTHING`` (INSERT and SELECT); the relay
reads and saves its claim front with ``INSERT … ON CONFLICT DO UPDATE … WHERE``
(SELECT, INSERT, UPDATE; ``outbox.db.front``); it moves due scheduled rows into the
outbox (schema 0009: ``DELETE … RETURNING`` from the scheduled table after locking
them ``FOR UPDATE SKIP LOCKED``, and an INSERT into the outbox).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

# Table roles, as in queries.table_identifiers: the outbox table and its companions.
OUTBOX, RELAYS, DEAD_LETTERS, SCHEMA_VERSION = "outbox", "relays", "dead_letters", "schema_version"
CLAIM_FRONT = "claim_front"
SCHEDULED = "scheduled"

Needs = Mapping[str, tuple[str, ...]]

RELAY: Needs = {
    OUTBOX: ("SELECT", "INSERT", "UPDATE", "DELETE"),
    DEAD_LETTERS: ("SELECT", "INSERT", "UPDATE"),
    RELAYS: ("SELECT", "INSERT", "UPDATE", "DELETE"),
    CLAIM_FRONT: ("SELECT", "INSERT", "UPDATE"),
    SCHEDULED: ("SELECT", "UPDATE", "DELETE"),
    SCHEMA_VERSION: ("SELECT",),
}
DEAD_LETTERS_WRITE: Needs = {DEAD_LETTERS: RELAY[DEAD_LETTERS]}
RESOLVE: Needs = {RELAYS: ("SELECT", "DELETE"), SCHEMA_VERSION: ("SELECT",)}
STATUS: Needs = {
    OUTBOX: ("SELECT",),
    DEAD_LETTERS: ("SELECT",),
    RELAYS: ("SELECT",),
    CLAIM_FRONT: ("SELECT",),
    SCHEDULED: ("SELECT",),
    SCHEMA_VERSION: ("SELECT",),
}
DEAD_LETTERS_LIST: Needs = {DEAD_LETTERS: ("SELECT",)}
DEAD_LETTERS_RETRY: Needs = {DEAD_LETTERS: ("SELECT", "DELETE"), OUTBOX: ("SELECT", "INSERT")}
DEAD_LETTERS_PURGE: Needs = {DEAD_LETTERS: ("SELECT", "DELETE")}


def table_name(table: str, role: str) -> str:
    """The real name of a table role for the outbox table ``table``."""
    return table if role == OUTBOX else f"{table}_{role}"


def wanted(table: str, needs: Needs) -> list[tuple[str, str]]:
    """(table name, privilege) pairs to check, in a stable order."""
    return [(table_name(table, role), p) for role, privileges in needs.items() for p in privileges]


_PLAIN = re.compile(r"^[a-z_][a-z0-9_$]*$")


def quote_role(name: str) -> str:
    """A role name as SQL writes it: plain when it can be, else double-quoted."""
    return name if _PLAIN.match(name) else '"' + name.replace('"', '""') + '"'


def grants(missing: Iterable[tuple[str, str]], role: str) -> list[str]:
    """One ``GRANT … ON … TO role;`` per table, privileges in the order given."""
    by_table: dict[str, list[str]] = {}
    for table, privilege in missing:
        privileges = by_table.setdefault(table, [])
        if privilege not in privileges:
            privileges.append(privilege)
    return [
        f"GRANT {', '.join(privileges)} ON {table} TO {quote_role(role)};"
        for table, privileges in by_table.items()
    ]
