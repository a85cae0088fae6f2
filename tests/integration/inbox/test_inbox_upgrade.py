"""The inbox tables of earlier versions upgrade in place at start-up: no row lost,
the upgrade idempotent, and a consumer of the earlier version (which never arms
the guard) still commits."""

from __future__ import annotations

import psycopg

from outbox.db.inbox import InboxStore, Parking

# The inbox tables as `outbox consume` created them before raw properties and the
# guard (0.1.0).
EARLIER = """
CREATE TABLE inbox (
    consumer text NOT NULL, message_id text NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (consumer, message_id));
CREATE INDEX inbox_by_age ON inbox (consumer, received_at);
CREATE TABLE inbox_attempts (
    consumer text NOT NULL, message_id text NOT NULL, attempts integer NOT NULL,
    last_error text NOT NULL, last_failed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id));
CREATE TABLE inbox_parked (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, consumer text NOT NULL,
    message_id text, queue text NOT NULL, exchange text NOT NULL, routing_key text NOT NULL,
    body bytea NOT NULL, headers jsonb NOT NULL, properties jsonb NOT NULL,
    error text NOT NULL, attempts integer NOT NULL,
    parked_at timestamptz NOT NULL DEFAULT now(), UNIQUE (consumer, message_id));
INSERT INTO inbox (consumer, message_id) SELECT 'q', 'old-' || n FROM generate_series(1, 500) n;
INSERT INTO inbox_attempts (consumer, message_id, attempts, last_error) VALUES ('q', 'a', 2, 'e');
INSERT INTO inbox_parked (consumer, message_id, queue, exchange, routing_key, body, headers,
                          properties, error, attempts)
VALUES ('q', 'p', 'q', 'ex', 'k', '\\x00', '{}', '{}', 'boom', 5);
"""


def counts(dsn: str) -> tuple[int, int, int]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM inbox), (SELECT count(*) FROM inbox_attempts), "
            "(SELECT count(*) FROM inbox_parked)"
        ).fetchone()
    assert row is not None
    return row[0], row[1], row[2]


def test_upgrade__earlier_inbox_tables_upgrade_in_place_and_keep_every_row(
    empty_dsn: str,
) -> None:
    with psycopg.connect(empty_dsn) as conn:
        conn.execute(EARLIER)
    store = InboxStore(empty_dsn, "inbox", "q")
    try:
        store.ensure_schema()
        store.ensure_schema()  # idempotent
        assert counts(empty_dsn) == (500, 1, 1)
        with psycopg.connect(empty_dsn) as conn:
            raw = conn.execute("SELECT raw_properties FROM inbox_parked").fetchone()
            assert raw == (None,)
            triggers = conn.execute(
                "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'inbox'::regclass "
                "AND tgname = 'inbox_guard'"
            ).fetchone()
            assert triggers == (1,)
        # The upgraded tables work: a duplicate of an old id, a new one, a parking.
        started, new = store.record_ids(["old-1", "new-1"], [])
        assert new == {"new-1"}
        assert store.seal() == started
        store.commit()
        store.park(Parking(None, "q", "ex", "k", b"x", {}, {}, "no id", b"\x00\x00"))
        assert counts(empty_dsn) == (501, 1, 2)
    finally:
        store.close()
    # A consumer of the earlier version inserts ids without arming the guard.
    with psycopg.connect(empty_dsn) as conn:
        conn.execute("INSERT INTO inbox (consumer, message_id) VALUES ('q', 'by-old-code')")
    assert counts(empty_dsn)[0] == 502


def test_upgrade__a_commit_inside_the_consumers_transaction_fails_by_itself(
    empty_dsn: str,
) -> None:
    store = InboxStore(empty_dsn, "inbox", "q")
    try:
        store.ensure_schema()
        store.record_ids(["m"], [])
        try:
            store.connection.execute("COMMIT")
        except psycopg.Error as exc:
            assert "a handler committed" in str(exc)
        else:
            raise AssertionError("the COMMIT went through")
        assert counts(empty_dsn)[0] == 0
        # Outside the consumer's transaction the session writes nothing.
        try:
            store.connection.execute("INSERT INTO inbox (consumer, message_id) VALUES ('q', 'x')")
        except psycopg.errors.ReadOnlySqlTransaction:
            pass
        else:
            raise AssertionError("a write outside the consumer's transaction went through")
    finally:
        store.close()
