-- Every SQL statement of the consumer's inbox (`outbox consume`), as named blocks.
-- The inbox lives in the CONSUMER's database, which need not be the outbox's, so it
-- is not part of the outbox migrations: `outbox consume` creates it at start-up and
-- `outbox consume --print-sql` prints the schema's blocks for a DBA.
-- Identifiers in braces ({inbox}, {attempts}, {parked}, {inbox_by_age}) are filled
-- in with psycopg.sql.Identifier for the configured table; values are %(name)s.

-- The inbox's schema, one block per piece, each idempotent.  `outbox consume` looks
-- in the catalog first (store.SCHEMA: one check per block, no lock on the tables)
-- and runs only the blocks whose piece is missing, under a short lock_timeout,
-- retried; `outbox consume --print-sql` prints them all, in this order.

-- --8<-- [start:schema] (docs/reference/schema.md shows the blocks from here)
-- create_inbox --
-- One row per message whose effect committed (or that was parked), per consumer.
-- The consumer name (default: the queue) is part of the key, so two services that
-- both receive a message and share a database each apply it once.
CREATE TABLE IF NOT EXISTS {inbox} (
    consumer    text        NOT NULL,
    message_id  text        NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
)

-- create_inbox_by_age --
-- For pruning.  Takes a SHARE lock on {inbox}, even when the index exists: it runs
-- only when the catalog says the index is missing.
CREATE INDEX IF NOT EXISTS {inbox_by_age} ON {inbox} (consumer, received_at)

-- create_attempts --
-- Failed attempts of messages not handled yet; a message is parked at --max-attempts.
CREATE TABLE IF NOT EXISTS {attempts} (
    consumer       text        NOT NULL,
    message_id     text        NOT NULL,
    attempts       integer     NOT NULL,
    last_error     text        NOT NULL,
    last_failed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
)

-- create_parked --
-- Messages taken off the queue without an effect: the handler kept failing, or the
-- message has no message_id.  A parked message's id is also in {inbox}, so a late
-- copy of it is skipped; `outbox parked retry` removes the id, sends the message
-- again, then removes the parked row (release_parked, retried_parked).
CREATE TABLE IF NOT EXISTS {parked} (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer    text        NOT NULL,
    message_id  text,
    queue       text        NOT NULL,
    exchange    text        NOT NULL,
    routing_key text        NOT NULL,
    body        bytea       NOT NULL,
    headers     jsonb       NOT NULL,
    properties  jsonb       NOT NULL,
    error       text        NOT NULL,
    attempts    integer     NOT NULL,
    parked_at   timestamptz NOT NULL DEFAULT now(),
    UNIQUE (consumer, message_id)
)

-- create_custody --
-- Messages the consumer took off the queue before it could apply them, because the
-- broker might drop them otherwise (custody): a quorum queue with a delivery limit
-- drops a message returned once too often, and every consumer crash returns all it
-- holds.  A message the broker has returned before is stored here and acked in one
-- transaction as soon as it arrives (take_custody), then applied from here, alone,
-- its attempts counted first (next_in_custody); the transaction that applies it
-- deletes its row (record_messages).  Rows of an ordering key go in id order.
CREATE TABLE IF NOT EXISTS {custody} (
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer       text        NOT NULL,
    message_id     text        NOT NULL,
    ordering_key   text,
    queue          text        NOT NULL,
    exchange       text        NOT NULL,
    routing_key    text        NOT NULL,
    body           bytea       NOT NULL,
    raw_properties bytea       NOT NULL,
    taken_at       timestamptz NOT NULL DEFAULT now(),
    not_before     timestamptz NOT NULL DEFAULT now(),
    UNIQUE (consumer, message_id)
)

-- add_parked_raw_properties --
-- The AMQP property list exactly as it arrived (headers with their AMQP types, a
-- message_id that is not UTF-8), sent back unchanged by `outbox parked retry`.  NULL
-- for rows parked before it existed (those are sent back from the headers and
-- properties columns, as before).  ACCESS EXCLUSIVE on {parked}, no rewrite.
ALTER TABLE {parked} ADD COLUMN IF NOT EXISTS raw_properties bytea

-- create_guard --
-- Ids are recorded first in the consumer's transaction, so a handler that ran
-- COMMIT would commit the ids of messages whose effects had not run yet.  The
-- consumer arms this check when it records ids and seals it just before its own
-- COMMIT; any other COMMIT of that transaction fails and rolls it back whole.
-- Transactions that never arm it (other writers, older consumers) are not affected.
CREATE OR REPLACE FUNCTION {guard}() RETURNS trigger LANGUAGE plpgsql AS $guard$
BEGIN
    IF current_setting('outbox.inbox_guard', true) = 'armed' THEN
        RAISE EXCEPTION 'a handler committed the transaction of outbox consume'
            USING HINT = 'a handler must not run COMMIT or ROLLBACK: the consumer '
                         'commits each effect together with its message id';
    END IF;
    RETURN NULL;
END
$guard$

-- create_guard_trigger --
-- A constraint trigger has no IF NOT EXISTS (SHARE ROW EXCLUSIVE on {inbox}).
DO $migrate$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                   WHERE tgrelid = to_regclass({inbox_name}) AND tgname = {guard_name}) THEN
        CREATE CONSTRAINT TRIGGER {guard} AFTER INSERT ON {inbox}
            DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {guard}();
    END IF;
END
$migrate$
-- --8<-- [end:schema]

-- record_message --
-- Records the id of a message being parked (its own transaction, not armed).  A
-- concurrent transaction holding the same id makes this one wait for its
-- outcome: committed means "duplicate" here, rolled back means this one goes on.
INSERT INTO {inbox} (consumer, message_id) VALUES (%(consumer)s, %(message_id)s)
ON CONFLICT DO NOTHING

-- record_messages --
-- The first statement of a batch's transaction: the batch's ids in one statement;
-- those it returns are new (their effects are applied next, in the same
-- transaction), the others are duplicates.  Sorted, so two consumers whose batches
-- share ids take their locks in the same order.  It also clears the attempt
-- counters of the ids that were delivered before (new, or applied meanwhile), arms
-- {guard} and returns when the transaction started, which `seal` compares before the
-- COMMIT.
WITH new AS (
    INSERT INTO {inbox} (consumer, message_id)
    SELECT %(consumer)s, id FROM unnest(%(ids)s::text[]) AS id ORDER BY id
    ON CONFLICT DO NOTHING
    RETURNING message_id
), forgotten AS (
    -- Also for a redelivered id found here already: another consumer applied a copy
    -- of it while this one counted its attempt (start_attempt sees no uncommitted id).
    DELETE FROM {attempts} a
    WHERE a.consumer = %(consumer)s AND a.message_id = ANY(%(redelivered)s::text[])
), released AS (
    -- A message applied from custody (it is applied as a redelivered one) leaves it
    -- in the transaction of its effect.
    DELETE FROM {custody} c
    WHERE c.consumer = %(consumer)s AND c.message_id = ANY(%(redelivered)s::text[])
)
SELECT now() AS started,
       set_config('outbox.inbox_guard', 'armed', true) AS guard,
       ARRAY(SELECT message_id FROM new) AS new

-- record_new --
-- record_messages for a batch whose ids go out ahead of its handlers' statements,
-- all taken for new (``steps.record_ahead``): a plain INSERT, without the speculative
-- insertion ON CONFLICT costs PostgreSQL for every row.  An id already here fails
-- it (a unique violation: the transaction is aborted, the handlers' statements
-- after it fail, nothing commits), and the batch runs again with record_messages.
-- A copy within the batch is inserted once (DISTINCT).
WITH new AS (
    INSERT INTO {inbox} (consumer, message_id)
    SELECT %(consumer)s, id FROM (SELECT DISTINCT id FROM unnest(%(ids)s::text[]) AS id) AS ids
    ORDER BY id
    RETURNING message_id
)
SELECT now() AS started,
       set_config('outbox.inbox_guard', 'armed', true) AS guard,
       ARRAY(SELECT message_id FROM new) AS new

-- seal --
-- The last statement before the consumer's COMMIT: when the transaction started
-- (the consumer compares it with record_messages': a handler that ended the
-- transaction and went on in a new one shows here) and {guard} sealed.
SELECT now() AS started, set_config('outbox.inbox_guard', 'sealed', true) AS guard

-- forget_attempts --
DELETE FROM {attempts} WHERE consumer = %(consumer)s AND message_id = %(message_id)s

-- count_attempt --
-- A failed attempt: %(increment)s is 0 when the attempt was counted before the
-- handler was called (start_attempt), so that no attempt is counted twice.
INSERT INTO {attempts} AS a (consumer, message_id, attempts, last_error)
VALUES (%(consumer)s, %(message_id)s, 1, %(error)s)
ON CONFLICT (consumer, message_id) DO UPDATE
SET attempts = a.attempts + %(increment)s, last_error = EXCLUDED.last_error,
    last_failed_at = now()
RETURNING attempts

-- start_attempt --
-- A redelivered message is applied alone, and its attempt is counted first, in a
-- transaction of its own (committed before the handler runs), so that the count
-- survives a handler that kills the process.  Nothing is written for an id already
-- in the inbox (a duplicate: no handler call) nor for a message whose earlier
-- attempts reached %(max_attempts)s (it is parked instead).  Returns whether the
-- id is in the inbox, the attempts before this one and the last error raised.
-- The caller holds the message's attempt lock (attempt_lock), so no other consumer
-- counts or applies a copy of it meanwhile; a duplicate's lock is released here.
-- The id is looked up under a lock: a transaction that is removing it (`outbox parked
-- retry` sending the message again) is waited for, so its copy is not taken for a
-- duplicate of a message that is about to be not in the inbox.
WITH done AS (
    SELECT EXISTS (SELECT 1 FROM {inbox}
                   WHERE consumer = %(consumer)s AND message_id = %(message_id)s
                   FOR KEY SHARE) AS done
), earlier AS (
    SELECT coalesce(max(attempts), 0) AS attempts, coalesce(max(last_error), '') AS last_error
    FROM {attempts} WHERE consumer = %(consumer)s AND message_id = %(message_id)s
), counted AS (
    INSERT INTO {attempts} AS a (consumer, message_id, attempts, last_error)
    SELECT %(consumer)s, %(message_id)s, 1, ''
    FROM done, earlier
    WHERE NOT done.done AND earlier.attempts < %(max_attempts)s
    ON CONFLICT (consumer, message_id) DO UPDATE
    SET attempts = a.attempts + 1, last_failed_at = now()
    RETURNING attempts
)
SELECT done.done AS duplicate, earlier.attempts AS earlier, earlier.last_error,
       CASE WHEN done.done THEN pg_advisory_unlock(%(lock_class)s, %(lock_key)s) END AS unlocked
FROM done, earlier

-- uncount_attempt --
-- A redelivered message whose attempt start_attempt counted, whose inbox row was
-- then found held by another transaction (InboxRowHeld): its handler was not
-- called, so that was no attempt.  Run while its attempt lock is still held.
UPDATE {attempts} SET attempts = attempts - 1
WHERE consumer = %(consumer)s AND message_id = %(message_id)s AND attempts > 0

-- attempt_lock --
-- Held by the session (not the transaction) from before start_attempt until the
-- message's outcome is committed, or until the process dies (the session ends).
SELECT pg_advisory_lock(%(lock_class)s, %(lock_key)s)

-- attempt_unlock --
SELECT pg_advisory_unlock(%(lock_class)s, %(lock_key)s)

-- park_message --
INSERT INTO {parked} AS p
    (consumer, message_id, queue, exchange, routing_key, body, headers, properties,
     raw_properties, error, attempts)
VALUES
    (%(consumer)s, %(message_id)s, %(queue)s, %(exchange)s, %(routing_key)s, %(body)s,
     %(headers)s, %(properties)s, %(raw_properties)s, %(error)s, %(attempts)s)
ON CONFLICT (consumer, message_id) DO UPDATE
SET queue = EXCLUDED.queue, exchange = EXCLUDED.exchange, routing_key = EXCLUDED.routing_key,
    body = EXCLUDED.body, headers = EXCLUDED.headers, properties = EXCLUDED.properties,
    raw_properties = EXCLUDED.raw_properties,
    error = EXCLUDED.error, attempts = p.attempts + EXCLUDED.attempts, parked_at = now()

-- prune_inbox --
-- One small batch of ids older than the retention window.  The locking sub-select
-- runs once (= ANY(ARRAY(...))); ids of parked messages stay until the parked row
-- is retried or purged.
DELETE FROM {inbox}
WHERE consumer = %(consumer)s
  AND message_id = ANY(ARRAY(
      SELECT i.message_id FROM {inbox} i
      WHERE i.consumer = %(consumer)s
        AND i.received_at < now() - make_interval(secs => %(retention)s::float8)
        AND NOT EXISTS (SELECT 1 FROM {parked} p
                        WHERE p.consumer = i.consumer AND p.message_id = i.message_id)
      ORDER BY i.received_at
      LIMIT %(batch)s
      FOR UPDATE OF i SKIP LOCKED))

-- prune_attempts --
DELETE FROM {attempts}
WHERE consumer = %(consumer)s
  AND last_failed_at < now() - make_interval(secs => %(retention)s::float8)

-- parked_count --
SELECT count(*) AS parked FROM {parked} WHERE consumer = %(consumer)s

-- list_parked --
-- Text columns cut at %(chars)s characters (the whole error's length in error_chars)
-- and headers shown only up to %(headers_bytes)s bytes of JSON (headers_bytes: their
-- size): what a list holds is bounded by its --limit, whatever a row holds (a
-- handler's error may quote a body of any size).
SELECT id, left(consumer, %(chars)s) AS consumer, left(message_id, %(chars)s) AS message_id,
       left(queue, %(chars)s) AS queue, left(exchange, %(chars)s) AS exchange,
       left(routing_key, %(chars)s) AS routing_key, octet_length(body) AS body_bytes,
       CASE WHEN octet_length(headers::text) <= %(headers_bytes)s THEN headers END AS headers,
       octet_length(headers::text) AS headers_bytes,
       left(error, %(chars)s) AS error, length(error) AS error_chars, attempts, parked_at
FROM {parked}
ORDER BY parked_at, id
LIMIT %(limit)s

-- last_parked --
-- Where a retry run stops: rows parked after it started (the same messages parked
-- again while the handler still fails) wait for the next run.
SELECT coalesce(max(id), 0) AS last FROM {parked}

-- parked_message --
-- One parked message, for a detail view: the first %(most)s bytes of its body and
-- their total (headers and properties as text).
SELECT id, consumer, message_id, queue, exchange, routing_key,
       substring(body FROM 1 FOR %(most)s) AS body, octet_length(body) AS body_bytes,
       left(headers::text, %(most)s) AS headers, length(headers::text) AS headers_chars,
       left(properties::text, %(most)s) AS properties,
       length(properties::text) AS properties_chars, error, attempts, parked_at
FROM {parked}
WHERE id = %(id)s

-- parked_value --
-- The whole body, headers or properties of one parked message, for a download: the
-- value only if it has at most %(most)s bytes, and its size.
SELECT CASE WHEN octet_length(v.value) <= %(most)s THEN v.value END AS value,
       octet_length(v.value) AS size
FROM {parked} p,
     LATERAL (SELECT CASE %(what)s WHEN 'body' THEN p.body
                                   WHEN 'headers' THEN convert_to(p.headers::text, 'UTF8')
                                   ELSE convert_to(p.properties::text, 'UTF8') END AS value) v
WHERE p.id = %(id)s

-- search_parked --
-- A page of the console's list over the whole table: every parked message whose
-- number is %(q)s or whose message id, consumer, queue, exchange, routing key or
-- error contains it (case-insensitive), oldest first, with the total; text cut at
-- %(chars)s characters as in list_parked.
SELECT id, left(consumer, %(chars)s) AS consumer, left(message_id, %(chars)s) AS message_id,
       left(queue, %(chars)s) AS queue, left(exchange, %(chars)s) AS exchange,
       left(routing_key, %(chars)s) AS routing_key, octet_length(body) AS body_bytes,
       left(error, %(chars)s) AS error, length(error) AS error_chars, attempts, parked_at,
       count(*) OVER () AS total
FROM {parked}
WHERE %(q)s = '' OR id::text = %(q)s OR message_id ILIKE %(like)s OR consumer ILIKE %(like)s
   OR queue ILIKE %(like)s OR exchange ILIKE %(like)s OR routing_key ILIKE %(like)s
   OR error ILIKE %(like)s
ORDER BY parked_at, id
LIMIT %(limit)s OFFSET %(offset)s

-- parked_groups --
-- The same parked messages by consumer and error, biggest group first, each named by
-- one of its rows (first_id); each group's error cut at %(chars)s characters.
SELECT left(consumer, %(chars)s) AS consumer, left(error, %(chars)s) AS error,
       length(error) AS error_chars, count(*) AS count, min(parked_at) AS oldest,
       min(id) AS first_id
FROM {parked}
WHERE %(q)s = '' OR id::text = %(q)s OR message_id ILIKE %(like)s OR consumer ILIKE %(like)s
   OR queue ILIKE %(like)s OR exchange ILIKE %(like)s OR routing_key ILIKE %(like)s
   OR error ILIKE %(like)s
GROUP BY consumer, error
ORDER BY count(*) DESC, min(parked_at), min(id)
LIMIT %(limit)s

-- parked_message_ids --
-- The message ids of these parked rows, and of the oldest %(limit)s rows in the same
-- group (consumer and error) as row %(group_of)s.
SELECT DISTINCT message_id FROM (
    SELECT message_id FROM {parked} WHERE id = ANY(%(ids)s::bigint[])
    UNION ALL
    (SELECT p.message_id FROM {parked} p
     JOIN {parked} g ON g.id = %(group_of)s AND p.consumer = g.consumer AND p.error = g.error
     ORDER BY p.parked_at, p.id
     LIMIT %(limit)s)
) AS chosen
WHERE message_id IS NOT NULL

-- select_parked --
-- What take_parked (retry) and purge_parked (without --older-than) take for the same
-- message ids, read without changing anything: the console shows it before the
-- operator confirms.
SELECT id, consumer, message_id, queue, exchange, routing_key, error, attempts, parked_at
FROM {parked}
WHERE message_id = ANY(%(ids)s::text[])
ORDER BY id

-- retry_sizes --
-- Retry, the next page: the parked rows after %(after)s up to %(last)s (each row at
-- most once per run) and their sizes, from which the caller takes as many as fit its
-- memory budget.  A row's size counts every column release_parked loads: the body,
-- the headers and properties (JSON, as text), the raw property list and the keys.
-- Messages without an id cannot be consumed: purge them.
SELECT id, octet_length(body) + octet_length(headers::text)
           + octet_length(properties::text) + coalesce(octet_length(raw_properties), 0)
           + octet_length(consumer) + octet_length(message_id) + octet_length(queue)
           + octet_length(exchange) + octet_length(routing_key) AS row_bytes
FROM {parked}
WHERE message_id IS NOT NULL AND (%(all)s OR message_id = ANY(%(ids)s::text[]))
  AND id > %(after)s AND id <= %(last)s
ORDER BY id
LIMIT %(limit)s

-- release_parked --
-- Retry, step 1 of 3 (a short transaction of its own): the parked rows with their
-- bodies; their inbox ids and attempt counters go, so the copy about to be sent is
-- applied, not skipped.  The parked rows stay until step 3 (retried_parked), after
-- the broker confirmed the copy: a crash in between leaves them listed, and a second
-- retry sends a copy the inbox skips if the first one was applied meanwhile.  So an
-- id goes only if the parking recorded it (in the parking's transaction: the same
-- now()), never one a copy's effect recorded since (in a transaction that started
-- after an earlier release committed: later).
WITH chosen AS (
    SELECT id, consumer, message_id, queue, exchange, routing_key, body, headers,
           properties, raw_properties, parked_at
    FROM {parked}
    WHERE id = ANY(%(ids)s::bigint[]) AND message_id IS NOT NULL
), unrecorded AS (
    DELETE FROM {inbox} i USING chosen c
    WHERE i.consumer = c.consumer AND i.message_id = c.message_id
      AND i.received_at <= c.parked_at
), reset AS (
    DELETE FROM {attempts} a USING chosen c
    WHERE a.consumer = c.consumer AND a.message_id = c.message_id
)
SELECT * FROM chosen ORDER BY id

-- retried_parked --
-- Retry, step 3 of 3: the parked rows whose copies the broker confirmed go, unless
-- parked again since step 1 (a copy that failed again: parked_at moved), which stay.
DELETE FROM {parked} p
USING unnest(%(ids)s::bigint[], %(parked_at)s::timestamptz[]) AS r(id, parked_at)
WHERE p.id = r.id AND p.parked_at = r.parked_at
RETURNING p.id

-- purge_parked --
DELETE FROM {parked}
WHERE (%(all)s OR message_id = ANY(%(ids)s::text[]))
  AND (%(older_than)s::float8 IS NULL
       OR parked_at < now() - make_interval(secs => %(older_than)s::float8))
RETURNING message_id

-- chart_sample --
-- What the console's charts sample from one inbox, in one round trip: messages
-- parked now, and counters of the statistics system: ids ever recorded in the inbox
-- (messages applied) and rows ever parked (inserted, or parked again).
SELECT (SELECT count(*) FROM {parked}) AS parked_now,
       coalesce((SELECT n_tup_ins FROM pg_stat_user_tables
                 WHERE relid = to_regclass(%(inbox)s)), 0) AS applied,
       coalesce((SELECT n_tup_ins + n_tup_upd FROM pg_stat_user_tables
                 WHERE relid = to_regclass(%(parked)s)), 0) AS parked

-- take_custody --
-- Messages the broker returned before, stored as they arrived (the property list
-- exactly, the body, where they came from), in one transaction, before they are
-- acked.  An id already in the inbox is not stored (a copy of an applied message:
-- acked as a duplicate); one already in custody is stored once.
INSERT INTO {custody} AS c
    (consumer, message_id, ordering_key, queue, exchange, routing_key, body, raw_properties)
SELECT %(consumer)s, m.message_id, m.ordering_key, %(queue)s, m.exchange, m.routing_key,
       m.body, m.raw_properties
FROM unnest(%(ids)s::text[], %(keys)s::text[], %(exchanges)s::text[],
            %(routing_keys)s::text[], %(bodies)s::bytea[], %(raws)s::bytea[])
     WITH ORDINALITY AS m(message_id, ordering_key, exchange, routing_key, body,
                          raw_properties, n)
WHERE NOT EXISTS (SELECT 1 FROM {inbox} i
                  WHERE i.consumer = %(consumer)s AND i.message_id = m.message_id)
ORDER BY m.n
ON CONFLICT (consumer, message_id) DO NOTHING

-- next_in_custody --
-- The messages in custody to apply next, oldest first: the first of each ordering
-- key (a later one waits while an earlier one of its key is here) and those without
-- one, if due (a failed one waits for its retry delay, and its key with it).  Also
-- how many are here in all and when the next one that is not due yet will be
-- (seconds from now).  The heads are found over narrow rows, and only the
-- %(limit)s to apply read with their bodies: sorting every row held with its body
-- spilled to disk once custody held thousands (30 ms a read at 5,000; now 8 ms).
WITH heads AS MATERIALIZED (
    SELECT DISTINCT ON (ordering_key IS NULL, coalesce(ordering_key, ''),
                        CASE WHEN ordering_key IS NULL THEN id END)
           id, not_before
    FROM {custody}
    WHERE consumer = %(consumer)s
    ORDER BY ordering_key IS NULL, coalesce(ordering_key, ''),
             CASE WHEN ordering_key IS NULL THEN id END, id
), due AS (
    SELECT id FROM heads WHERE not_before <= now() ORDER BY id LIMIT %(limit)s
)
SELECT c.id, c.message_id, c.queue, c.exchange, c.routing_key, c.body, c.raw_properties,
       (SELECT count(*) FROM {custody} WHERE consumer = %(consumer)s) AS held,
       (SELECT extract(epoch FROM min(not_before) - now()) FROM heads
        WHERE not_before > now()) AS next_in
FROM due JOIN {custody} c ON c.id = due.id
UNION ALL
-- one row with the figures, last (alone when none is due)
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       (SELECT count(*) FROM {custody} WHERE consumer = %(consumer)s),
       (SELECT extract(epoch FROM min(not_before) - now()) FROM heads
        WHERE not_before > now())
ORDER BY id NULLS LAST

-- delay_custody --
-- A message in custody whose attempt failed waits %(delay)s seconds for the next.
UPDATE {custody} SET not_before = now() + make_interval(secs => %(delay)s::float8)
WHERE consumer = %(consumer)s AND message_id = %(message_id)s

-- release_custody --
-- A message in custody that was parked, or found applied already (a copy).
DELETE FROM {custody} WHERE consumer = %(consumer)s AND message_id = %(message_id)s

-- custody_count --
SELECT count(*) AS held FROM {custody} WHERE consumer = %(consumer)s
