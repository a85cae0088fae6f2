-- 0004: ordering keys PostgreSQL cannot index never stop a row (issue 19).
-- A B-tree entry holds at most about 2,704 bytes: the dead letters' index on
-- (ordering_key, id) refused a row whose key was longer, so the row could be
-- neither published nor dead-lettered.  The index is now on an md5 of the key
-- (32 characters, whatever the key's length); lookups compare the md5 and the
-- key itself.  The outbox has no index on the key (only on id), so nothing
-- there can overflow.
-- New rows' keys are limited to 1,024 bytes, so an application learns at INSERT
-- that a key is not an aggregate's id.  NOT VALID: rows written before are not
-- checked (and are relayed as ever), and adding it scans nothing, so the outbox's
-- lock is held for a moment only; outbox.message.ORDERING_KEY_MAX_BYTES says the
-- same to the Python APIs.  ADD CONSTRAINT has no IF NOT EXISTS: a rerun after a
-- killed init finds it there and goes on.
DO $$
BEGIN
    ALTER TABLE {outbox} ADD CONSTRAINT {outbox_ordering_key_length}
        CHECK (octet_length(ordering_key) <= 1024) NOT VALID;
EXCEPTION WHEN duplicate_object THEN
    NULL;
END
$$;
-- outside a transaction --
CREATE INDEX CONCURRENTLY IF NOT EXISTS {dead_letters_ordering_key_md5}
    ON {dead_letters} (md5(ordering_key), id) WHERE ordering_key IS NOT NULL;
DROP INDEX CONCURRENTLY IF EXISTS {dead_letters_ordering_key};
