-- 0003: per-key ordering.  Rows sharing a non-NULL ordering_key reach the broker in
-- id order (docs/explanation/ordering.md); NULL keeps the row free of any constraint.
-- The claim reads the front of the keyed rows through the partial index; dead
-- letters carry the key so that one can hold its key's later rows back.
-- Online (outbox.db.migrate): the outbox table last, its index built concurrently.
ALTER TABLE {dead_letters} ADD COLUMN IF NOT EXISTS ordering_key text;
ALTER TABLE {outbox} ADD COLUMN IF NOT EXISTS ordering_key text;
-- outside a transaction --
CREATE INDEX CONCURRENTLY IF NOT EXISTS {outbox_ordering_key} ON {outbox} (id)
    WHERE ordering_key IS NOT NULL;
CREATE INDEX CONCURRENTLY IF NOT EXISTS {dead_letters_ordering_key}
    ON {dead_letters} (ordering_key, id) WHERE ordering_key IS NOT NULL;
