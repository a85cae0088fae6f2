import pytest

from outbox.config import Settings
from outbox.db import migrate
from outbox.db.queries import Queries, _raw_blocks


def test_queries__every_block_composes_for_a_custom_table() -> None:
    queries = Queries("shop_outbox")
    for name in _raw_blocks():
        text = queries[name].as_string(None)
        assert "{" not in text or "'" in text, name  # no unfilled placeholder
        if "outbox" in text:
            assert '"shop_outbox' in text, name


def test_migrations__are_numbered_from_one_without_gaps() -> None:
    versions = [m.version for m in migrate.migrations()]
    assert versions == list(range(1, len(versions) + 1))
    assert versions[-1] == migrate.LATEST_VERSION


def test_render_sql__each_migration_is_a_transaction_then_its_concurrent_indexes() -> None:
    text = migrate.render_sql("billing_outbox")
    assert text.startswith("-- outbox schema")
    assert "SET lock_timeout = '500ms';" in text
    assert text.count("BEGIN;") == text.count("COMMIT;") == len(migrate.migrations())
    assert 'CREATE TABLE IF NOT EXISTS "billing_outbox"' in text
    assert '"billing_outbox_dead_letters"' in text
    for migration in migrate.migrations():
        transaction, _, after = text.partition(f"-- {migration.name}\nBEGIN;")[2].partition(
            "COMMIT;"
        )
        assert "CONCURRENTLY" not in transaction
        version_row = after.index(f"(version, name) SELECT {migration.version}, ")
        assert after[:version_row].count("CONCURRENTLY") == len(migration.outside_a_transaction)


def _statements(text: str) -> list[str]:
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("--")]
    return [" ".join(s.split()) for s in "\n".join(lines).split(";") if s.strip()]


@pytest.mark.parametrize("migration", migrate.migrations(), ids=lambda m: m.name)
def test_migrations__build_every_index_concurrently_outside_the_transaction(
    migration: migrate.Migration,
) -> None:
    """CREATE INDEX in a transaction holds a SHARE lock for the whole build: every
    INSERT waits (issue 19).  0001 creates empty tables, where that costs nothing."""
    if migration.version == 1:
        return
    for statement in _statements(migration.in_transaction):
        assert not statement.upper().startswith(("CREATE INDEX", "CREATE UNIQUE INDEX")), statement
    for statement in migration.outside_a_transaction:
        assert statement.upper().startswith(
            (
                "CREATE INDEX CONCURRENTLY IF NOT EXISTS",
                "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS",
                "DROP INDEX CONCURRENTLY IF EXISTS",
            )
        ), statement


@pytest.mark.parametrize("migration", migrate.migrations(), ids=lambda m: m.name)
def test_migrations__lock_the_outbox_table_last_in_their_transaction(
    migration: migrate.Migration,
) -> None:
    """While the transaction holds the outbox's lock the application waits: nothing
    may then wait for another table's lock, or run long, after it."""
    if migration.version == 1:
        return
    statements = _statements(migration.in_transaction)
    on_outbox = [i for i, s in enumerate(statements) if "{outbox}" in s.replace("'{outbox}'", "")]
    others = ("{dead_letters}", "{relays}", "{schema_version}")
    if on_outbox:
        after = statements[on_outbox[0] :]
        assert not [s for s in after if any(other in s for other in others)], statements


def test_migration__statements_outside_the_transaction_one_by_one() -> None:
    migration = migrate.Migration(
        9,
        "0009_x.sql",
        "ALTER TABLE {outbox} ADD COLUMN IF NOT EXISTS x int;\n"
        "-- outside a transaction --\n"
        "-- a comment;\n"
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS {outbox_x}\n    ON {outbox} (x);\n"
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS {outbox_y} ON {outbox} (y);\n",
    )
    assert (
        migration.in_transaction.strip() == "ALTER TABLE {outbox} ADD COLUMN IF NOT EXISTS x int;"
    )
    assert migration.outside_a_transaction == [
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS {outbox_x} ON {outbox} (x)",
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS {outbox_y} ON {outbox} (y)",
    ]


@pytest.mark.parametrize("name", ["Outbox", "1outbox", "out-box", "x" * 42, "a;drop"])
def test_settings__reject_unsafe_table_names(name: str) -> None:
    with pytest.raises(ValueError, match="table name"):
        Settings(table=name)
