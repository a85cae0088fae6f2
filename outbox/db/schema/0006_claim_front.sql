-- 0006: claims whose cost does not grow with dead rows (issue 33).
-- A claim used to start at the lowest id and walk every row deleted since the MVCC
-- horizon was taken: while a report, pg_dump or an idle transaction holds it, those
-- dead rows and their index entries cannot be removed, and each claim read them all
-- again.  A relay now starts its claims at a low-water mark (``queries.sql``,
-- ``claim_batch``) and finds the rows that commit behind it by the transaction that
-- inserted them: txid, the inserting transaction's id, is compared with the
-- snapshot of the relay's previous claim.
-- Online (outbox.db.migrate): ADD COLUMN without a default rewrites nothing, and SET
-- DEFAULT only changes the catalog, so the outbox is locked for a moment only.  The
-- lock waits for every transaction that inserted into the outbox before it, so once
-- this commits no row without a txid can still commit: the rows written before it
-- (txid NULL) are all visible to the relay's first claim, which walks from the
-- bottom.  Rows keep NULL: filling them in would rewrite every row of the table.
-- The index is built concurrently, outside the transaction: relays of 0.5 and
-- earlier ignore the column.
ALTER TABLE {outbox} ADD COLUMN IF NOT EXISTS txid xid8;
ALTER TABLE {outbox} ALTER COLUMN txid SET DEFAULT pg_current_xact_id();
-- outside a transaction --
CREATE INDEX CONCURRENTLY IF NOT EXISTS {outbox_txid} ON {outbox} (txid);
