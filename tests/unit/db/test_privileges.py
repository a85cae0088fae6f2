"""The GRANT statements a missing privilege is reported with."""

from __future__ import annotations

from outbox.db import privileges


def test_wanted__names_the_real_tables_of_a_custom_outbox() -> None:
    pairs = privileges.wanted("shop_outbox", privileges.DEAD_LETTERS_RETRY)
    assert pairs == [
        ("shop_outbox_dead_letters", "SELECT"),
        ("shop_outbox_dead_letters", "DELETE"),
        ("shop_outbox", "SELECT"),
        ("shop_outbox", "INSERT"),
    ]


def test_grants__one_statement_per_table() -> None:
    missing = [
        ("outbox", "UPDATE"),
        ("outbox_dead_letters", "INSERT"),
        ("outbox", "DELETE"),
        ("outbox", "UPDATE"),
    ]
    assert privileges.grants(missing, "relay") == [
        "GRANT UPDATE, DELETE ON outbox TO relay;",
        "GRANT INSERT ON outbox_dead_letters TO relay;",
    ]


def test_grants__quotes_a_role_name_sql_would_fold_or_reject() -> None:
    assert privileges.grants([("outbox", "SELECT")], 'Relay "A"') == [
        'GRANT SELECT ON outbox TO "Relay ""A""";'
    ]


def test_relay_needs__cover_every_table_the_loop_touches() -> None:
    assert set(privileges.RELAY) == {
        "outbox",
        "relays",
        "dead_letters",
        "claim_front",
        "scheduled",
        "schema_version",
    }
    assert "UPDATE" in privileges.RELAY["outbox"], "FOR UPDATE SKIP LOCKED needs UPDATE"
    assert "INSERT" in privileges.RELAY["outbox"], "the mover inserts due scheduled rows"
