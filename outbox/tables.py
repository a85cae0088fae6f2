"""The outbox's tables: which names a table may have, and the identifiers of the
outbox table and its companions (relays, dead letters, schema version, saved claim
front, scheduled rows, triggers)."""

from __future__ import annotations

import re

from psycopg import sql

TABLE_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,40}$")

# The suffixes of the outbox table's name that name its tables, the outbox first:
# what a demo or a benchmark drops when it is done with its own outbox.
TABLE_SUFFIXES = ("", "_relays", "_dead_letters", "_claim_front", "_schema_version", "_scheduled")


def table_names(table: str) -> list[str]:
    """The outbox table and every companion table, by name (``TABLE_SUFFIXES``)."""
    return [f"{table}{suffix}" for suffix in TABLE_SUFFIXES]


def function_names(table: str) -> list[str]:
    """The trigger functions of the outbox table (a dropped table leaves them)."""
    return [f"{table}{suffix}" for suffix in ("_notify", "_stamp_txid", "_schedule")]


def table_identifiers(table: str) -> dict[str, sql.Identifier]:
    """The identifiers derived from the outbox table's name."""
    return {
        "outbox": sql.Identifier(table),
        "relays": sql.Identifier(f"{table}_relays"),
        "dead_letters": sql.Identifier(f"{table}_dead_letters"),
        "dead_letters_pkey": sql.Identifier(f"{table}_dead_letters_pkey"),
        "dead_letters_message_id": sql.Identifier(f"{table}_dead_letters_message_id"),
        "outbox_ordering_key": sql.Identifier(f"{table}_ordering_key"),
        "dead_letters_ordering_key": sql.Identifier(f"{table}_dead_letters_ordering_key"),
        "dead_letters_ordering_key_md5": sql.Identifier(f"{table}_dead_letters_ordering_key_md5"),
        "outbox_ordering_key_length": sql.Identifier(f"{table}_ordering_key_length"),
        "outbox_txid": sql.Identifier(f"{table}_txid"),
        "schema_version": sql.Identifier(f"{table}_schema_version"),
        "claim_front": sql.Identifier(f"{table}_claim_front"),
        "notify_function": sql.Identifier(f"{table}_notify"),
        "notify_trigger": sql.Identifier(f"{table}_notify"),
        "stamp_function": sql.Identifier(f"{table}_stamp_txid"),
        "stamp_trigger": sql.Identifier(f"{table}_stamp_txid"),
        "scheduled": sql.Identifier(f"{table}_scheduled"),
        "scheduled_due": sql.Identifier(f"{table}_scheduled_due"),
        "scheduled_message_id": sql.Identifier(f"{table}_scheduled_message_id"),
        # Named to sort before the stamp trigger: BEFORE triggers fire in name order.
        "schedule_function": sql.Identifier(f"{table}_schedule"),
        "schedule_trigger": sql.Identifier(f"{table}_schedule"),
    }
