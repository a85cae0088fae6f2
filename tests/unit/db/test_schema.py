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


def test_render_sql__is_one_transaction_for_the_named_table() -> None:
    text = migrate.render_sql("billing_outbox")
    assert text.startswith("-- outbox schema") and "BEGIN;" in text and text.endswith("COMMIT;\n")
    assert 'CREATE TABLE IF NOT EXISTS "billing_outbox"' in text
    assert '"billing_outbox_dead_letters"' in text


@pytest.mark.parametrize("name", ["Outbox", "1outbox", "out-box", "x" * 42, "a;drop"])
def test_settings__reject_unsafe_table_names(name: str) -> None:
    with pytest.raises(ValueError, match="table name"):
        Settings(table=name)
