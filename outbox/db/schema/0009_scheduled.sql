-- 0009: messages at a time (delivery at `deliver_at`) and their cancellation.
-- A row written with `deliver_at` in the future (later than its transaction's
-- now()) is not put in the outbox: a BEFORE INSERT trigger diverts it into
-- {scheduled} (RETURN NULL), where the claims never look, so rows not yet due cost
-- a claim nothing however many there are.  A relay's mover (``move_due`` in
-- queries.sql) moves the due rows into the outbox in due order, in a short
-- transaction of its own, with a new id; the stamp trigger gives them the mover's
-- txid, so the claim front, ordering keys and 2PC apply to them unchanged.  NULL or
-- a time not in the future: the row goes to the outbox at once, as before.
-- The trigger fires before the stamp trigger (names in order), and stamps the
-- diverted row itself.  It is the one way in for every writer: plain SQL, the
-- Python API, the integrations, COPY.  The statement-level wake-up trigger still
-- fires (an idle relay re-reads the next due time).
-- Online: a new table (its indexes built concurrently); ADD COLUMN without a default rewrites nothing; CREATE
-- TRIGGER takes SHARE ROW EXCLUSIVE on the outbox for a moment, last.  Relays of
-- 0.7 ignore the column and never see a diverted row: they publish nothing
-- scheduled, early or late, until a relay of this version runs.
CREATE TABLE IF NOT EXISTS {scheduled} (
    id           bigint      PRIMARY KEY,
    message_id   uuid        NOT NULL,
    exchange     text        NOT NULL,
    routing_key  text        NOT NULL,
    payload      bytea       NOT NULL,
    headers      jsonb,
    content_type text,
    created_at   timestamptz NOT NULL,
    ordering_key text,
    txid         xid8        NOT NULL,
    deliver_at   timestamptz NOT NULL
);
ALTER TABLE {scheduled} SET (
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_analyze_scale_factor = 0.05
);
-- Who writes the outbox (INSERT: applications) may schedule and cancel; who claims
-- (DELETE: relays) may move due rows into it.  The outbox's owner too, if another
-- role runs this (its rights are implicit: its ACL may be empty).  An upgrade needs
-- no GRANT of its own.
DO $grants$
DECLARE
    grantee oid;
BEGIN
    FOR grantee IN
        SELECT DISTINCT a.grantee FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = '{outbox}'::regclass AND a.privilege_type = 'INSERT'
          AND a.grantee NOT IN (0, c.relowner)
        UNION
        SELECT c.relowner FROM pg_class c WHERE c.oid = '{outbox}'::regclass
    LOOP
        EXECUTE format('GRANT SELECT, INSERT, DELETE ON {scheduled} TO %s', grantee::regrole);
    END LOOP;
    FOR grantee IN
        SELECT DISTINCT a.grantee FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = '{outbox}'::regclass AND a.privilege_type = 'DELETE'
          AND a.grantee NOT IN (0, c.relowner)
    LOOP
        EXECUTE format('GRANT SELECT, UPDATE, DELETE ON {scheduled} TO %s', grantee::regrole);
        EXECUTE format('GRANT INSERT ON {outbox} TO %s', grantee::regrole);
    END LOOP;
    FOR grantee IN
        SELECT DISTINCT a.grantee FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = '{outbox}'::regclass AND a.privilege_type = 'SELECT'
          AND a.grantee NOT IN (0, c.relowner)
    LOOP
        EXECUTE format('GRANT SELECT ON {scheduled} TO %s', grantee::regrole);
    END LOOP;
END
$grants$;
CREATE OR REPLACE FUNCTION {schedule_function}() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {scheduled} (id, message_id, exchange, routing_key, payload, headers,
                             content_type, created_at, ordering_key, txid, deliver_at)
    VALUES (NEW.id, NEW.message_id, NEW.exchange, NEW.routing_key, NEW.payload, NEW.headers,
            NEW.content_type, NEW.created_at, NEW.ordering_key, pg_current_xact_id(),
            NEW.deliver_at);
    RETURN NULL;
END
$$;
-- The wake-up trigger stays quiet for a relay's mover (its session sets
-- outbox.mover): the mover claims what it moved itself, and idle relays woken by
-- each other's moves would wake each other for ever.
CREATE OR REPLACE FUNCTION {notify_function}() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('outbox.mover', true) = 'on' THEN
        RETURN NULL;
    ELSIF pg_try_advisory_lock(7299705, TG_RELID::integer) THEN
        PERFORM pg_advisory_unlock(7299705, TG_RELID::integer);
    ELSE
        PERFORM pg_notify(TG_TABLE_NAME, '');
    END IF;
    RETURN NULL;
END
$$;
ALTER TABLE {outbox} ADD COLUMN IF NOT EXISTS deliver_at timestamptz;
DO $schedule$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_trigger
        WHERE tgrelid = '{outbox}'::regclass AND tgfoid = '{schedule_function}'::regproc
    ) THEN
        -- The WHEN clause keeps the trigger's function off the hot path: a row due
        -- now costs one comparison.
        CREATE TRIGGER {schedule_trigger} BEFORE INSERT ON {outbox}
            FOR EACH ROW WHEN (NEW.deliver_at > now())
            EXECUTE FUNCTION {schedule_function}();
    END IF;
END
$schedule$;
-- The due order, for the mover; message ids, for cancel.  Built concurrently, as
-- every index (the table fills from the moment the trigger exists).
-- outside a transaction --
CREATE INDEX CONCURRENTLY IF NOT EXISTS {scheduled_due} ON {scheduled} (deliver_at, id);
CREATE INDEX CONCURRENTLY IF NOT EXISTS {scheduled_message_id} ON {scheduled} (message_id);
