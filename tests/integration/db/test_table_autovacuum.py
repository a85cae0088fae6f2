"""``outbox bench --horizon --table-autovacuum server`` measures the outbox against the
server's autovacuum defaults: the table's own parameters (schema 0001) must be gone."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from outbox.bench.horizon import TABLE_AUTOVACUUM, table_autovacuum


def _autovacuum_options(conn: psycopg.Connection[Any]) -> set[str]:
    row = conn.execute(
        "SELECT coalesce(reloptions, '{}') FROM pg_class WHERE oid = 'outbox'::regclass"
    ).fetchone()
    assert row is not None
    return {o.split("=")[0] for o in row[0] if o.startswith("autovacuum")}


def test_table_autovacuum__server_resets_every_parameter_outbox_init_sets(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert _autovacuum_options(conn) == set(TABLE_AUTOVACUUM)
        table_autovacuum(conn, "outbox", "outbox")
        assert _autovacuum_options(conn) == set(TABLE_AUTOVACUUM)
        table_autovacuum(conn, "outbox", "server")
        assert _autovacuum_options(conn) == set()
        with pytest.raises(ValueError, match="unknown"):
            table_autovacuum(conn, "outbox", "none")
