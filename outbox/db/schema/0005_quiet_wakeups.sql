-- 0005: the wake-up NOTIFY only while a relay waits for it (issue 21).
-- A transaction that ran NOTIFY takes one lock for the whole database at COMMIT and
-- holds it until its commit record is flushed, so the commits of the transactions
-- that wrote to the outbox could not share a WAL flush: with a 1 ms flush simulated
-- (commit_delay), 800 to 1,588 commits/s in all, against 2,768 to 7,540 without the
-- trigger (pgbench, 16 clients;
-- docs/benchmarks.md#the-applications-commits-and-the-wake-up-trigger).  Now the trigger notifies
-- only while some relay waits for work: an idle relay holds the advisory lock
-- (7299705, the table's oid) in shared mode on its wake-up session, a busy relay
-- does not (``outbox.db.relays.WakeupListener``).  pg_try_advisory_lock fails while
-- anyone holds it, and the trigger then notifies; otherwise it lets the lock go at
-- once.  Advisory locks are not transactional and need no privilege: every
-- application role, at every isolation level, sees the relays' state as it is now.
-- A relay of 0.4 or earlier never takes the lock: between this migration and its
-- replacement it is woken only while a relay of 0.5 waits, else by its fallback
-- poll (--poll-interval; docs/how-to/upgrading.md).
-- CREATE OR REPLACE FUNCTION takes no lock on the outbox: the trigger runs the new
-- body from the next statement on.
CREATE OR REPLACE FUNCTION {notify_function}() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF pg_try_advisory_lock(7299705, TG_RELID::integer) THEN
        PERFORM pg_advisory_unlock(7299705, TG_RELID::integer);
    ELSE
        PERFORM pg_notify(TG_TABLE_NAME, '');
    END IF;
    RETURN NULL;
END
$$;
