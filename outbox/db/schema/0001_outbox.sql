-- 0001: the outbox table, the relay registry, dead letters and the wake-up trigger.
-- Placeholders in braces are identifiers filled in by outbox.migrate (psycopg.sql).

CREATE TABLE IF NOT EXISTS {outbox} (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id   uuid        NOT NULL DEFAULT gen_random_uuid(),
    exchange     text        NOT NULL DEFAULT '',
    routing_key  text        NOT NULL DEFAULT '',
    payload      bytea       NOT NULL DEFAULT '\x'::bytea,
    headers      jsonb,
    content_type text,
    created_at   timestamptz NOT NULL DEFAULT now()
);

-- Rows are inserted and deleted all day long: vacuum early and often so that the
-- claim query never wades through dead tuples
-- (docs/how-to/operations.md#retention-and-table-health).
ALTER TABLE {outbox} SET (
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0.0,
    autovacuum_vacuum_insert_threshold = 20000,
    autovacuum_analyze_scale_factor = 0.05
);

-- One row per relay process; the advisory lock (lock_key) held by its control
-- session is what proves it alive, heartbeat_at is the fallback for partitions.
CREATE TABLE IF NOT EXISTS {relays} (
    relay_id     text        PRIMARY KEY,
    lock_key     integer     NOT NULL,
    hostname     text        NOT NULL,
    pid          integer     NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now()
);

-- Rows that can never be published, with the reason; `outbox dead-letters retry`
-- puts them back into the outbox.
CREATE TABLE IF NOT EXISTS {dead_letters} (
    message_id   uuid        PRIMARY KEY,
    exchange     text        NOT NULL,
    routing_key  text        NOT NULL,
    payload      bytea       NOT NULL,
    headers      jsonb,
    content_type text,
    created_at   timestamptz NOT NULL,
    reason       text        NOT NULL,
    gid          text,
    attempts     integer     NOT NULL DEFAULT 1,
    failed_at    timestamptz NOT NULL DEFAULT now()
);

-- Wake idle relays on every committed insert.  Statement level, so a multi-row
-- insert sends one notification; PostgreSQL folds identical ones per transaction.
-- The relay never inserts into the outbox, so its own (prepared) transactions
-- never fire it.
CREATE OR REPLACE FUNCTION {notify_function}() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_TABLE_NAME, '');
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS {notify_trigger} ON {outbox};
CREATE TRIGGER {notify_trigger}
    AFTER INSERT ON {outbox}
    FOR EACH STATEMENT EXECUTE FUNCTION {notify_function}();
