-- 0008: a row's txid is always the transaction that wrote it, and the safety net's
-- schedule is the table's, not a session's.
-- The claims find a row that commits behind their low-water mark by its txid
-- (0006, ``outbox/db/front.py``), and an application could write that column:
-- `INSERT … SELECT *` from a copy or a backup of the outbox, a reload after TRUNCATE
-- or DELETE, explicit values.  Such a row was found only by the safety net (up to
-- 15 minutes later, never if the relays kept restarting), and the later rows of its
-- ordering key went out before it.  Now a trigger stamps every row written (INSERT,
-- COPY, UPDATE) with the writing transaction, whatever the statement said: the
-- next claim after its commit finds it, ahead of its key.  ENABLE ALWAYS: it fires
-- in a logical replication apply worker too (session_replication_role = replica),
-- where the copied txid is the publisher's.  Only a trigger switched off (`ALTER
-- TABLE … DISABLE TRIGGER`, `pg_restore --disable-triggers`) lets a foreign txid in.
-- The safety net's passes (``front.RescanPass``) are scheduled and carried in the
-- saved front's row: when the pass under way began, how far it got, the rows it
-- found; when the last whole pass began and what it found.  Any relay's session
-- takes the next slice and records it with the rows it found, so a pass survives
-- restarts and reconnects and is shared by all relays.
-- Online: the new columns of the front's row have constant defaults (no rewrite);
-- CREATE TRIGGER takes SHARE ROW EXCLUSIVE on the outbox for a moment, last, and
-- waits for every transaction writing to it, so once this commits every row written
-- without the trigger has committed (a safety-net pass finds those below the front).
-- Relays of 0.6 ignore the new columns and the trigger.
ALTER TABLE {claim_front}
    ADD COLUMN IF NOT EXISTS pass_end bigint,
    ADD COLUMN IF NOT EXISTS pass_at bigint NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS pass_began_at timestamptz,
    ADD COLUMN IF NOT EXISTS pass_found bigint NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS last_pass_at timestamptz,
    ADD COLUMN IF NOT EXISTS last_pass_found bigint;
CREATE OR REPLACE FUNCTION {stamp_function}() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.txid := pg_current_xact_id();
    RETURN NEW;
END
$$;
DO $stamp$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_trigger
        WHERE tgrelid = '{outbox}'::regclass AND tgfoid = '{stamp_function}'::regproc
    ) THEN
        CREATE TRIGGER {stamp_trigger} BEFORE INSERT OR UPDATE ON {outbox}
            FOR EACH ROW EXECUTE FUNCTION {stamp_function}();
        ALTER TABLE {outbox} ENABLE ALWAYS TRIGGER {stamp_trigger};
    END IF;
END
$stamp$;
