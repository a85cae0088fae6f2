-- Every SQL statement of the consumer's inbox (`outbox consume`), as named blocks.
-- The inbox lives in the CONSUMER's database, which need not be the outbox's, so it
-- is not part of the outbox migrations: `outbox consume` creates it at start-up and
-- `outbox consume --print-sql` prints the `schema` block for a DBA.
-- Identifiers in braces ({inbox}, {attempts}, {parked}, {inbox_by_age}) are filled
-- in with psycopg.sql.Identifier for the configured table; values are %(name)s.

-- schema --
-- One row per message whose effect committed (or that was parked), per consumer.
-- The consumer name (default: the queue) is part of the key, so two services that
-- both receive a message and share a database each apply it once.
CREATE TABLE IF NOT EXISTS {inbox} (
    consumer    text        NOT NULL,
    message_id  text        NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS {inbox_by_age} ON {inbox} (consumer, received_at);
-- Failed attempts of messages not handled yet; a message is parked at --max-attempts.
CREATE TABLE IF NOT EXISTS {attempts} (
    consumer       text        NOT NULL,
    message_id     text        NOT NULL,
    attempts       integer     NOT NULL,
    last_error     text        NOT NULL,
    last_failed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
-- Messages taken off the queue without an effect: the handler kept failing, or the
-- message has no message_id.  A parked message's id is also in {inbox}, so a late
-- copy of it is skipped; `outbox parked retry` removes both in one transaction.
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
);

-- record_message --
-- The first statement of every message's transaction.  A concurrent transaction
-- holding the same id makes this one wait for its outcome: committed means
-- "duplicate" here, rolled back means this one goes ahead.
INSERT INTO {inbox} (consumer, message_id) VALUES (%(consumer)s, %(message_id)s)
ON CONFLICT DO NOTHING

-- record_messages --
-- The batch's ids in one statement; those it returns are new (their effects are
-- applied next, in the same transaction), the others are duplicates.  Sorted, so
-- two consumers whose batches share ids take their locks in the same order.
INSERT INTO {inbox} (consumer, message_id)
SELECT %(consumer)s, id FROM unnest(%(ids)s::text[]) AS id ORDER BY id
ON CONFLICT DO NOTHING
RETURNING message_id

-- forget_attempts_of --
DELETE FROM {attempts} WHERE consumer = %(consumer)s AND message_id = ANY(%(ids)s::text[])

-- forget_attempts --
DELETE FROM {attempts} WHERE consumer = %(consumer)s AND message_id = %(message_id)s

-- count_attempt --
INSERT INTO {attempts} AS a (consumer, message_id, attempts, last_error)
VALUES (%(consumer)s, %(message_id)s, 1, %(error)s)
ON CONFLICT (consumer, message_id) DO UPDATE
SET attempts = a.attempts + 1, last_error = EXCLUDED.last_error, last_failed_at = now()
RETURNING attempts

-- park_message --
INSERT INTO {parked} AS p
    (consumer, message_id, queue, exchange, routing_key, body, headers, properties,
     error, attempts)
VALUES
    (%(consumer)s, %(message_id)s, %(queue)s, %(exchange)s, %(routing_key)s, %(body)s,
     %(headers)s, %(properties)s, %(error)s, %(attempts)s)
ON CONFLICT (consumer, message_id) DO UPDATE
SET queue = EXCLUDED.queue, exchange = EXCLUDED.exchange, routing_key = EXCLUDED.routing_key,
    body = EXCLUDED.body, headers = EXCLUDED.headers, properties = EXCLUDED.properties,
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
SELECT id, consumer, message_id, queue, exchange, routing_key, octet_length(body) AS body_bytes,
       headers, properties, error, attempts, parked_at
FROM {parked}
ORDER BY parked_at, id
LIMIT %(limit)s

-- parked_message --
-- One parked message whole, for a detail view (headers and properties as text).
SELECT id, consumer, message_id, queue, exchange, routing_key, body, headers::text AS headers,
       properties::text AS properties, error, attempts, parked_at
FROM {parked}
WHERE id = %(id)s

-- select_parked --
-- What take_parked (retry) and purge_parked (without --older-than) take for the same
-- message ids, read without changing anything: the console shows it before the
-- operator confirms.
SELECT id, consumer, message_id, queue, exchange, routing_key, error, attempts, parked_at
FROM {parked}
WHERE message_id = ANY(%(ids)s::text[])
ORDER BY id

-- take_parked --
-- Retry, step 1 (the caller publishes the rows, then commits): remove the parked
-- rows and the inbox ids they hold, and reset their attempts.  Until the commit a
-- consumer that receives the republished message waits on the inbox id; if the
-- retry dies before committing, the parked row and the id come back and the copy
-- is skipped as a duplicate.  Messages without an id cannot be consumed: purge them.
WITH taken AS (
    DELETE FROM {parked}
    WHERE id = ANY(ARRAY(
        SELECT id FROM {parked}
        WHERE message_id IS NOT NULL AND (%(all)s OR message_id = ANY(%(ids)s::text[]))
        ORDER BY id
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED))
    RETURNING id, consumer, message_id, queue, exchange, routing_key, body, headers, properties
), unrecorded AS (
    DELETE FROM {inbox} i USING taken t
    WHERE i.consumer = t.consumer AND i.message_id = t.message_id
), reset AS (
    DELETE FROM {attempts} a USING taken t
    WHERE a.consumer = t.consumer AND a.message_id = t.message_id
)
SELECT consumer, message_id, queue, exchange, routing_key, body, headers, properties
FROM taken
ORDER BY id

-- purge_parked --
DELETE FROM {parked}
WHERE (%(all)s OR message_id = ANY(%(ids)s::text[]))
  AND (%(older_than)s::float8 IS NULL
       OR parked_at < now() - make_interval(secs => %(older_than)s::float8))
RETURNING message_id
