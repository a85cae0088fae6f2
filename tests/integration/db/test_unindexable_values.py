"""Values PostgreSQL cannot index end in one place (issue 19, item 2).

The only user-filled indexed text column was the dead letters' ordering key (a
B-tree entry holds about 2,704 bytes): schema 0004 indexes an md5 of it instead,
and limits new outbox rows' keys to ``ORDERING_KEY_MAX_BYTES`` (CHECK for plain
SQL, ``ValueError`` from the Python APIs before anything is written).  The other
indexed columns hold values of fixed size (ids, uuids) or that the relay writes
itself (relay ids, gids).
"""

from __future__ import annotations

import contextlib
import secrets
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import errors as pgerrors

import outbox
from outbox.config import Settings
from outbox.errors import ExitCode
from outbox.message import ORDERING_KEY_MAX_BYTES
from tests.fixtures.faults import prepared_left
from tests.fixtures.servers import Topology, run_cli, settings_env
from tests.integration.relay.test_relay import relay_drain, remaining_rows

LONG_KEY_BYTES = 3200  # the key: 3,224 bytes in the B-tree entry


def indexed_text_columns(dsn: str) -> set[tuple[str, str]]:
    """(table, column) of every text column used by an index of the outbox's tables."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT c.relname, a.attname FROM pg_index i "
            "JOIN pg_class c ON c.oid = i.indrelid "
            "JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = ANY(i.indkey) "
            "WHERE c.relname LIKE 'outbox%%' AND a.atttypid = 'text'::regtype"
        ).fetchall()
    return {(table, column) for table, column in rows}


def test_schema__no_user_filled_text_is_indexed_as_it_is(settings: Settings) -> None:
    """relay_id and the schema version's file name are the relay's own; the ordering
    key is indexed through md5 (an expression: no text column in ``indkey``)."""
    assert indexed_text_columns(settings.dsn) == {("outbox_relays", "relay_id")}


@contextlib.contextmanager
def before_the_limit(dsn: str) -> Iterator[None]:
    """Inside, applications write as they could before schema 0004."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE outbox DROP CONSTRAINT outbox_ordering_key_length")
        yield
        conn.execute(
            "ALTER TABLE outbox ADD CONSTRAINT outbox_ordering_key_length "
            f"CHECK (octet_length(ordering_key) <= {ORDERING_KEY_MAX_BYTES}) NOT VALID"
        )


def test_long_key_written_before_the_limit__unroutable_row_is_a_dead_letter(
    settings: Settings, topology: Topology
) -> None:
    """Before: 'index row size 3224 exceeds btree version 4 maximum 2704', forever."""
    long_key = secrets.token_urlsafe(LONG_KEY_BYTES * 3 // 4)
    nowhere = f"nobody.bound.{uuid.uuid4().hex}"
    with before_the_limit(settings.dsn), psycopg.connect(settings.dsn) as conn:
        conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload, ordering_key) VALUES "
            "('', %s, 'unroutable', %s), (%s, 'k', 'same key, held back', %s), "
            "(%s, 'k', 'other', 'k2')",
            [nowhere, long_key, topology.exchange, long_key, topology.exchange],
        )

    relay = relay_drain(settings)

    assert [body for _, _, body in topology.messages()] == [b"other"]
    with psycopg.connect(settings.dsn) as conn:
        letters = conn.execute(
            "SELECT payload, ordering_key, reason FROM outbox_dead_letters ORDER BY id"
        ).fetchall()
    assert [(bytes(p), k) for p, k, _ in letters] == [
        (b"unroutable", long_key),
        (b"same key, held back", long_key),
    ]
    assert "held back" in letters[1][2]
    assert relay.stats.batches_rolled_back == 0
    assert remaining_rows(settings.dsn) == 0 and prepared_left(settings.dsn) == []


def test_plain_sql__key_over_the_limit_is_refused_at_insert(settings: Settings) -> None:
    with psycopg.connect(settings.dsn) as conn:
        conn.execute(
            "INSERT INTO outbox (routing_key, ordering_key) VALUES ('k', %s)",
            ["é" * (ORDERING_KEY_MAX_BYTES // 2)],  # 1,024 bytes: the most allowed
        )
    with (
        psycopg.connect(settings.dsn) as conn,
        pytest.raises(pgerrors.CheckViolation, match="outbox_ordering_key_length"),
    ):
        conn.execute(
            "INSERT INTO outbox (routing_key, ordering_key) VALUES ('k', %s)",
            ["k" * (ORDERING_KEY_MAX_BYTES + 1)],
        )
    assert remaining_rows(settings.dsn) == 1


def test_enqueue__key_over_the_limit_is_refused_before_writing(settings: Settings) -> None:
    with psycopg.connect(settings.dsn) as conn:
        outbox.enqueue(conn, exchange="", routing_key="k", payload=b"", ordering_key="k" * 1024)
        with pytest.raises(ValueError, match=r"ordering_key is 1,025 bytes long.*1,024"):
            outbox.enqueue(
                conn, exchange="", routing_key="k", payload=b"", ordering_key="€" * 341 + "kk"
            )
        with pytest.raises(ValueError, match="ordering_key"):
            outbox.enqueue_many(
                conn, [outbox.OutgoingMessage("", "k", b"", ordering_key="x" * 2000)]
            )
    assert remaining_rows(settings.dsn) == 1


def test_dead_letters_retry__key_over_the_limit_says_what_to_do(settings: Settings) -> None:
    """A dead letter recorded before 0004 cannot go back as it is: a clear error."""
    with psycopg.connect(settings.dsn) as conn:
        conn.execute(
            "INSERT INTO outbox_dead_letters (id, message_id, exchange, routing_key, payload, "
            "created_at, ordering_key, reason) "
            "VALUES (1000, gen_random_uuid(), '', 'k', '', now(), %s, 'old')",
            ["k" * LONG_KEY_BYTES],
        )
    result = run_cli("dead-letters", "retry", "--all", env=settings_env(settings))
    assert result.returncode == int(ExitCode.FAILURE), result
    assert "longer than the 1,024 bytes" in result.stderr
    assert "purge" in result.stderr and "Traceback" not in result.stderr
    with psycopg.connect(settings.dsn) as conn:
        assert conn.execute("SELECT count(*) FROM outbox_dead_letters").fetchone() == (1,)
