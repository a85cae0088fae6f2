-- 0002: a dead letter is keyed by its outbox row's id, not by message_id.
-- Rows may share a message_id (an application re-enqueueing with the id its
-- consumers deduplicate on); keyed by message_id, two bad rows sharing one were
-- merged into one dead letter and the other payload was lost (issue 9).
-- Dead letters recorded before this migration get fresh ids from the outbox's
-- identity sequence, so they can never collide with a row's.
ALTER TABLE {dead_letters} ADD COLUMN IF NOT EXISTS id bigint;
UPDATE {dead_letters}
SET id = nextval(pg_get_serial_sequence('{outbox}', 'id'))
WHERE id IS NULL;
ALTER TABLE {dead_letters} ALTER COLUMN id SET NOT NULL;
ALTER TABLE {dead_letters} DROP CONSTRAINT IF EXISTS {dead_letters_pkey};
ALTER TABLE {dead_letters} ADD PRIMARY KEY (id);
-- outside a transaction --
CREATE INDEX CONCURRENTLY IF NOT EXISTS {dead_letters_message_id} ON {dead_letters} (message_id);
