-- Every SQL statement of the package, as named blocks (`-- name --`).
-- Identifiers in braces ({outbox}, {relays}, {dead_letters}) are filled in with
-- psycopg.sql.Identifier for the configured table; values are %(name)s parameters.

-- claim_batch --
-- Lock and delete up to `limit` committed rows nobody else holds.  The delete only
-- becomes final with COMMIT PREPARED; ROLLBACK PREPARED puts every row back.
--
-- Where the claim looks (``outbox/db/front.py``, the design): at ids from the
-- relay's low-water mark %(low_water)s (W) on, and at the `late` rows below it:
-- the ids it already knows (%(late)s) that still exist, and the rows whose inserting
-- transaction (txid, schema 0006) the previous claim's snapshot %(seen)s did not
-- see, found through the txid index (a range from its xmax, point lookups for the
-- transactions it saw in progress and that have ended since: `committed_since`,
-- the rows committed since that claim, whatever their id; one still running, a
-- bulk load say, is looked up only once it has ended, not at every claim).  So
-- the claim never walks the rows deleted before W, however many dead ones vacuum
-- cannot remove while the horizon is held.
-- And, during a pass of the safety net (``front.RescanPass``), the rows below W in
-- the heap pages [%(slice_from)s, %(slice_to)s) (a TID range scan: it reads those
-- pages, dead rows and all, and nothing else; an empty range reads nothing): a
-- row whose txid the application wrote is found there.
-- `committed_since` has no condition on id, and is MATERIALIZED so that none is
-- pushed into it: with `id < W` there, the generic plan walked the primary key
-- from the bottom to W and filtered on txid (the very walk this avoids).  So is
-- `sliced`, for the same reason: with `id < W` beside its TID range, the generic
-- plan chose the primary key once the statistics had seen the dead rows (an
-- ANALYZE, autovacuum's), and every claim read every dead row below W: 0.55 ms to
-- 68 ms per claim over 10 minutes of a held snapshot, 2,610 blocks for 200,000.
-- `start` is the smallest id visible now at or after W (locked or not): the one
-- walk over the rows deleted since the claim before; the other scans of the
-- front start there (none when it is NULL: no row at or after W is visible).
-- The last row of the result is not a row but the next front (`id` NULL): the
-- smallest id visible now at or after W (`start`), the late ids that still
-- exist (claimed now included: a batch rolled back puts them back), this
-- statement's snapshot, and `found`: the rows below W of the slice that only the
-- slice revealed (neither late already nor found by their txid: rows whose txid
-- is not their writer's), for the safety net's record (``front.NetState``).  Every part of the statement sees the one snapshot it
-- was started with, from before its own delete.
--
-- The locking sub-selects are MATERIALIZED CTEs inside one ARRAY(…) InitPlan:
-- PostgreSQL evaluates each exactly once, whatever the statistics say.  Written as
-- `id IN (SELECT … SKIP LOCKED)` it becomes a semi-join, and on a table whose
-- statistics say "nearly empty" (the normal state of an outbox, analyzed between
-- bursts) the planner may put it on the inner side of a nested loop: rescanned
-- once per outer row, each rescan locking other rows, so one claim took 50 s and
-- deleted 19,994 rows under LIMIT 1000.  tests/integration/db/test_claim_plan.py
-- pins this plan.
--
-- Rows with an ordering key (docs/explanation/ordering.md) are taken only as a prefix
-- of their key: a key's first row in the outbox (its head) and the rows right
-- behind it, never a row while an earlier row of its key is held by anyone else.
-- `keyed` is the front of the keyed rows, in id order, locked or not: the late
-- ones, then those from W on; a key's first row there is its first row in the
-- outbox (every row below W that exists and is visible is late), so no index probe
-- per row is needed.  A head held by another batch (prepared, or being claimed) is
-- skipped, and with it its whole key.  `late_heads` and `front_heads` lock unkeyed
-- rows and free heads (the late ones first, by id; the front by an index scan
-- from W); `tails` then locks the rows behind our heads (no other relay can hold
-- those: it would need the head), looked up by id (as `id IN (…)`, a semi-join,
-- the generic plan read the whole primary key, dead entries and all, to merge
-- it).  `gaps` is the first row of each key that we did not lock: nothing of
-- that key at or after it is taken.  A claim therefore holds
-- at most a prefix of each key, and a key's next rows are claimable only once its
-- batch is committed, except behind the relay's own batch in flight: `own` lists
-- its keyed rows, which count as taken, and the relay publishes the new batch only
-- after committing that one (``batches.py``, "the schedule").  `own` is looked up
-- through a hashed SubPlan (`NOT IN (SELECT unnest(…))`): `id <> ALL (%(own)s)`
-- compares each row of the window with every element of the array in the generic
-- plan (PostgreSQL hashes such an array only when it is a constant), 5 x 1,000 x
-- 1,000 comparisons per claim: 65 of the 85 ms of a claim of 1,000 keys behind the
-- relay's own batch.
--
-- `front_heads` passes over the rows that other batches hold (prepared, not yet
-- committed: still visible to this snapshot) without trying to lock them: a row whose
-- xmax is a prepared transaction's is held by that batch, and SKIP LOCKED would skip
-- it anyway, but only after a tuple lock and a try on the transaction's lock in the
-- lock manager.  With 4 relays of 2 batches in flight each, a claim of 1,000 rows
-- passed 7,000 such rows: 20 ms of its backend's CPU, 12.6 ms without the tries
-- (4 sessions claiming 1,000 rows in turn from 80,000 of 1 KiB, issue 33).  The
-- rows are still read: only the lock manager is spared.
-- Only a hint: a batch finished since this statement's start is skipped this once
-- (committed: the rows are gone; rolled back: the next claim takes them, W did not
-- pass them, `start` does not look at xmax), and a row held by a claim not yet
-- prepared is still skipped by SKIP LOCKED.
--
-- `held_by`: with %(hold)s (dead letters block their key), the first dead letter
-- of the row's key with a lower id (through the index on md5(ordering_key), id:
-- a key of any length can be indexed that way, schema 0004); the relay moves such a row to the dead letters
-- too, so a blocked key never piles up in front of the others.
--
-- The batch also stops at `max_bytes` of payload (the first row always goes, however
-- large), so the relay's memory does not grow with the payloads; octet_length()
-- reads a TOASTed value's size without fetching it.  Rows locked beyond the budget
-- stay locked until this batch is finished, then the next claim takes them.
WITH committed_since AS MATERIALIZED (
    SELECT id FROM {outbox} WHERE txid >= pg_snapshot_xmax(%(seen)s::pg_snapshot)
    UNION ALL
    SELECT id FROM {outbox}
    WHERE txid = ANY (ARRAY (
        SELECT x FROM pg_snapshot_xip(%(seen)s::pg_snapshot) AS x
        WHERE pg_visible_in_snapshot(x, pg_current_snapshot())))
), sliced AS MATERIALIZED (
    SELECT id FROM {outbox} WHERE ctid >= %(slice_from)s::tid AND ctid < %(slice_to)s::tid
), late AS MATERIALIZED (
    SELECT id FROM {outbox} WHERE id = ANY (%(late)s::bigint[])
    UNION
    SELECT id FROM committed_since WHERE id < %(low_water)s
    UNION
    SELECT id FROM sliced WHERE id < %(low_water)s
), start AS MATERIALIZED (
    SELECT id FROM {outbox} WHERE id >= %(low_water)s ORDER BY id LIMIT 1
), claimed AS (
    DELETE FROM {outbox}
    WHERE id = ANY (ARRAY (
        WITH keyed AS MATERIALIZED (
            SELECT id, ordering_key FROM (
                SELECT id, ordering_key FROM {outbox}
                WHERE id = ANY (ARRAY (SELECT id FROM late)) AND ordering_key IS NOT NULL
                  AND id NOT IN (SELECT unnest(%(own)s::bigint[]))
                UNION ALL
                (SELECT id, ordering_key FROM {outbox}
                 WHERE ordering_key IS NOT NULL AND id >= (SELECT id FROM start)
                   AND id NOT IN (SELECT unnest(%(own)s::bigint[]))
                 ORDER BY id
                 LIMIT %(window)s)
            ) AS front
            ORDER BY id
            LIMIT %(window)s
        ), firsts AS MATERIALIZED (
            SELECT DISTINCT ON (ordering_key) id FROM keyed ORDER BY ordering_key, id
        ), late_heads AS MATERIALIZED (
            SELECT id, ordering_key, octet_length(payload) AS size FROM {outbox}
            WHERE id = ANY (ARRAY (SELECT id FROM late))
              AND (ordering_key IS NULL OR id IN (SELECT id FROM firsts))
            ORDER BY id
            LIMIT %(limit)s
            FOR UPDATE SKIP LOCKED
        ), front_heads AS MATERIALIZED (
            SELECT id, ordering_key, octet_length(payload) AS size FROM {outbox}
            WHERE id >= (SELECT id FROM start)
              AND (ordering_key IS NULL OR id IN (SELECT id FROM firsts))
              AND xmax <> ALL (ARRAY (SELECT transaction FROM pg_prepared_xacts))
            ORDER BY id
            LIMIT (SELECT %(limit)s - count(*) FROM late_heads)
            FOR UPDATE SKIP LOCKED
        ), heads AS (
            SELECT id, ordering_key, size FROM late_heads
            UNION ALL
            SELECT id, ordering_key, size FROM front_heads
        ), tails AS MATERIALIZED (
            SELECT id, ordering_key, octet_length(payload) AS size FROM {outbox}
            WHERE id = ANY (ARRAY (
                SELECT k.id FROM keyed k JOIN heads h ON h.ordering_key = k.ordering_key
                WHERE k.id > h.id))
            ORDER BY id
            LIMIT (SELECT %(limit)s - count(*) FROM heads)
            FOR UPDATE SKIP LOCKED
        ), locked AS (
            SELECT id, ordering_key, size FROM heads
            UNION ALL
            SELECT id, ordering_key, size FROM tails
        ), gaps AS (
            SELECT ordering_key, min(id) AS gap FROM keyed
            WHERE id NOT IN (SELECT id FROM locked)
            GROUP BY ordering_key
        ), taken AS (
            SELECT l.id, l.size FROM locked l LEFT JOIN gaps g ON g.ordering_key = l.ordering_key
            WHERE g.gap IS NULL OR l.id < g.gap
        )
        SELECT id FROM (
            SELECT id, sum(size) OVER (ORDER BY id) - size AS before FROM taken
        ) AS sized
        WHERE before < %(max_bytes)s
    ))
    RETURNING id, message_id, exchange, routing_key, payload, headers, content_type, created_at,
        ordering_key,
        CASE WHEN %(hold)s AND ordering_key IS NOT NULL THEN (
            SELECT min(d.id) FROM {dead_letters} d
            WHERE md5(d.ordering_key) = md5({outbox}.ordering_key)
              AND d.ordering_key = {outbox}.ordering_key AND d.id < {outbox}.id)
        END AS held_by
)
SELECT id, message_id, exchange, routing_key, payload, headers, content_type, created_at,
       ordering_key, held_by,
       NULL::bigint AS low_water, NULL::bigint[] AS late, NULL::text AS seen, NULL::bigint AS found
FROM claimed
UNION ALL
SELECT NULL::bigint, NULL::uuid, NULL::text, NULL::text, NULL::bytea, NULL::jsonb, NULL::text,
       NULL::timestamptz, NULL::text, NULL::bigint,
       (SELECT id FROM start),
       ARRAY (SELECT id FROM late ORDER BY id),
       pg_current_snapshot()::text,
       (SELECT count(*) FROM sliced
        WHERE id < %(low_water)s AND id NOT IN (SELECT unnest(%(late)s::bigint[]))
          AND id NOT IN (SELECT id FROM committed_since))

-- has_claimable_rows --
-- Any row nobody holds, where the claim looks (``claim_batch``): from W, the late
-- ids, and the rows committed since the claim's snapshot, whatever their id.  Each
-- look is an ORDER BY … LIMIT 1 on its index: as EXISTS the planner may choose a
-- sequential scan, which reads every dead row from the start of the table.
SELECT (SELECT id FROM {outbox} WHERE id >= %(low_water)s ORDER BY id LIMIT 1
        FOR UPDATE SKIP LOCKED) IS NOT NULL
    OR (SELECT id FROM {outbox} WHERE id = ANY (%(late)s::bigint[]) ORDER BY id LIMIT 1
        FOR UPDATE SKIP LOCKED) IS NOT NULL
    OR (SELECT id FROM {outbox} WHERE txid >= pg_snapshot_xmax(%(seen)s::pg_snapshot)
        ORDER BY txid LIMIT 1 FOR UPDATE SKIP LOCKED) IS NOT NULL
    OR (SELECT id FROM {outbox}
        WHERE txid = ANY (ARRAY (
            SELECT x FROM pg_snapshot_xip(%(seen)s::pg_snapshot) AS x
            WHERE pg_visible_in_snapshot(x, pg_current_snapshot())))
        ORDER BY txid LIMIT 1 FOR UPDATE SKIP LOCKED) IS NOT NULL
    AS claimable

-- heap_pages --
-- The outbox's heap pages now (``front.RescanPass``): no scan, the file's size.
SELECT coalesce(pg_relation_size(to_regclass(%(table)s)), 0)
       / current_setting('block_size')::bigint AS pages

-- saved_front --
-- The front saved by the relays (``outbox/db/front.py``, "A new session"), if any,
-- with where it was computed, and where this session runs: the cluster, its
-- timeline, the outbox table's file and the xmax of a snapshot taken now.  A new
-- session starts from it only if it is this cluster's, on this timeline, for this
-- table's file, and not ahead (``front.resumed``).  And the safety net's schedule
-- saved with it (``net_columns``, ``front.NetState``).
SELECT s.system_identifier AS here_system_identifier, c.timeline_id AS here_timeline,
       pg_relation_filenode(to_regclass(%(table)s))::bigint AS here_filenode,
       pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS here_xmax,
       f.low_water, f.late, f.seen::text AS seen, f.system_identifier, f.timeline,
       f.filenode::bigint AS filenode, pg_snapshot_xmax(f.seen)::text::bigint AS seen_xmax,
       {net_columns}
FROM pg_control_system() AS s
CROSS JOIN pg_control_checkpoint() AS c
LEFT JOIN {claim_front} AS f ON true

-- net_columns --
-- The safety net's schedule as saved with the front (``front.NetState``; schema
-- 0008), its times as text and as ages; composed into ``saved_front`` and
-- ``locked_front`` over the row `f`.
f.pass_end, f.pass_at, f.pass_began_at::text AS pass_began, f.pass_found,
extract(epoch FROM now() - f.pass_began_at)::float8 AS pass_age,
f.last_pass_at::text AS last_pass_at, f.last_pass_found,
extract(epoch FROM now() - f.last_pass_at)::float8 AS last_pass_age

-- locked_front --
-- The saved front's row, locked until this session's save commits
-- (``BatchStore.save_front``), with where it was computed and where this session
-- runs now, the outbox's heap pages (a pass begun now reads them) and the time now
-- (when such a pass began).  No row: none was saved yet.  In a transaction of its
-- own, never inside a claim (a claim is prepared: the lock would be held until its
-- COMMIT PREPARED, serialising the relays).
SELECT f.low_water, f.late, f.seen::text AS seen, f.system_identifier, f.timeline,
       f.filenode::bigint AS filenode, pg_snapshot_xmax(f.seen)::text::bigint AS seen_xmax,
       {net_columns},
       pg_relation_filenode(to_regclass(%(table)s))::bigint AS here_filenode,
       s.system_identifier AS here_system_identifier, c.timeline_id AS here_timeline,
       coalesce(pg_relation_size(to_regclass(%(table)s)), 0)
           / current_setting('block_size')::bigint AS pages,
       now()::text AS now
FROM {claim_front} AS f
CROSS JOIN pg_control_system() AS s
CROSS JOIN pg_control_checkpoint() AS c
FOR UPDATE OF f

-- here --
-- Where this session runs now (``locked_front`` found no saved front).
SELECT pg_relation_filenode(to_regclass(%(table)s))::bigint AS here_filenode,
       s.system_identifier AS here_system_identifier, c.timeline_id AS here_timeline,
       coalesce(pg_relation_size(to_regclass(%(table)s)), 0)
           / current_setting('block_size')::bigint AS pages,
       now()::text AS now
FROM pg_control_system() AS s CROSS JOIN pg_control_checkpoint() AS c

-- write_front --
-- Save a front and the safety net's schedule (``BatchStore.save_front`` decided
-- them under ``locked_front``'s lock): the row if there is none, else replaced.
-- The late ids are those of both fronts that still exist below the W saved (a
-- slice's finds stay saved whichever relay's front is fresher; ids gone are
-- dropped so the list does not grow), looked up by id under the claim's planner
-- settings (never a scan of the dead rows).
INSERT INTO {claim_front} AS f
    (low_water, late, seen, system_identifier, timeline, filenode, saved_at,
     pass_end, pass_at, pass_began_at, pass_found, last_pass_at, last_pass_found)
VALUES (
    %(low_water)s,
    ARRAY (SELECT id FROM {outbox}
           WHERE id = ANY (%(late)s::bigint[]) AND id < %(low_water)s ORDER BY id),
    %(seen)s::pg_snapshot, %(system_identifier)s, %(timeline)s, %(filenode)s::bigint::oid, now(),
    %(pass_end)s, %(pass_at)s, %(pass_began)s::timestamptz, %(pass_found)s,
    %(last_pass_at)s::timestamptz, %(last_pass_found)s)
ON CONFLICT (slot) DO UPDATE
SET low_water = EXCLUDED.low_water, late = EXCLUDED.late, seen = EXCLUDED.seen,
    system_identifier = EXCLUDED.system_identifier, timeline = EXCLUDED.timeline,
    filenode = EXCLUDED.filenode, saved_at = EXCLUDED.saved_at, pass_end = EXCLUDED.pass_end,
    pass_at = EXCLUDED.pass_at, pass_began_at = EXCLUDED.pass_began_at,
    pass_found = EXCLUDED.pass_found, last_pass_at = EXCLUDED.last_pass_at,
    last_pass_found = EXCLUDED.last_pass_found

-- exact_backlog --
-- Every row of the outbox, counted by reading the whole table (``outbox status
-- --exact``): the rows the cheap count (``backlog``) cannot see are included, and so
-- is every dead row a held horizon keeps (a scan of the table: seconds on a large
-- one, on demand only).
SELECT count(*) AS rows,
       coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE isfinite(created_at))),
                0)::float8 AS oldest_age_seconds
FROM {outbox}

-- record_dead_letters --
-- Keyed by the outbox row's id: rows sharing a message_id stay separate dead
-- letters.  A conflict is the same row dead-lettered again after its batch was
-- rolled back (it was then in both tables for a moment).  created_at and headers
-- may arrive as the text PostgreSQL sent (values Python cannot hold, such as
-- 'infinity'): the server parses them back into the same value.
INSERT INTO {dead_letters}
    (id, message_id, exchange, routing_key, payload, headers, content_type, created_at,
     ordering_key, reason, gid)
VALUES
    (%(id)s, %(message_id)s, %(exchange)s, %(routing_key)s, %(payload)s, %(headers)s::jsonb,
     %(content_type)s, %(created_at)s::timestamptz, %(ordering_key)s, %(reason)s, %(gid)s)
ON CONFLICT (id) DO UPDATE
SET reason = EXCLUDED.reason, gid = EXCLUDED.gid, failed_at = now(),
    attempts = {dead_letters}.attempts + 1

-- prepared_gid_exists --
SELECT EXISTS (
    SELECT 1 FROM pg_prepared_xacts
    WHERE gid = %(gid)s AND database = current_database()
) AS present

-- own_backend --
-- This session's backend, named so that a later session can tell it from another
-- process that reused its pid (``BatchStore.end_predecessor``).
SELECT pid, backend_start, application_name
FROM pg_stat_activity WHERE pid = pg_backend_pid()

-- end_backend --
-- End a session of ours that lost its client and may still be running a statement
-- (a PREPARE or COMMIT PREPARED whose reply never arrived, or not yet read), or
-- holding a claim open.  Same role: no extra privilege.  A row comes back while it
-- still exists.  Never this session: a pooler may hand it the same server process.
SELECT pg_terminate_backend(pid) AS signalled
FROM pg_stat_activity
WHERE pid = %(pid)s AND backend_start = %(started)s
  AND application_name = %(application_name)s
  AND pid <> pg_backend_pid()

-- prepared_batches --
SELECT gid, prepared, owner, database = current_database() AS local,
       extract(epoch FROM now() - prepared)::float8 AS age_seconds
FROM pg_prepared_xacts
ORDER BY prepared

-- replication --
-- Standbys this server streams to, and how many of them are synchronous.  Without
-- pg_monitor a role sees the rows but not their state (NULL).
SELECT count(*) AS standbys,
       count(*) FILTER (WHERE sync_state IN ('sync', 'quorum')) AS synchronous,
       count(*) FILTER (WHERE sync_state IS NULL) AS hidden
FROM pg_stat_replication

-- max_prepared_transactions --
SELECT current_setting('max_prepared_transactions')::int AS slots

-- register_relay --
INSERT INTO {relays} (relay_id, lock_key, hostname, pid)
VALUES (%(relay_id)s, %(lock_key)s, %(hostname)s, %(pid)s)
ON CONFLICT (relay_id) DO UPDATE SET heartbeat_at = now()

-- try_lock_relay --
SELECT pg_try_advisory_lock(%(lock_class)s, %(lock_key)s) AS locked

-- unlock_relay --
-- Lets go of a session-level lock taken with try_lock_relay (the hand-over lock,
-- ``outbox.gid.HANDOVER_LOCK_CLASS``, once its holder is done with the relay id).
SELECT pg_advisory_unlock(%(lock_class)s, %(lock_key)s) AS unlocked

-- heartbeat --
UPDATE {relays} SET heartbeat_at = now() WHERE relay_id = %(relay_id)s

-- rows_waiting --
-- The idle relay's fallback poll (a NOTIFY normally wakes it first).  Rows held by
-- an in-doubt batch count too: at worst one empty claim.
-- Where the claim looks (``claim_batch``; %(low_water)s etc.: the relay's claim
-- front, ``outbox/db/front.py``), so the poll does not walk the dead rows behind
-- it either (each look an ORDER BY … LIMIT 1 on its index: ``has_claimable_rows``).
SELECT (SELECT id FROM {outbox} WHERE id >= %(low_water)s ORDER BY id LIMIT 1) IS NOT NULL
    OR (SELECT id FROM {outbox} WHERE id = ANY (%(late)s::bigint[]) LIMIT 1) IS NOT NULL
    OR (SELECT txid FROM {outbox} WHERE txid >= pg_snapshot_xmax(%(seen)s::pg_snapshot)
        ORDER BY txid LIMIT 1) IS NOT NULL
    OR (SELECT txid FROM {outbox}
        WHERE txid = ANY (ARRAY (
            SELECT x FROM pg_snapshot_xip(%(seen)s::pg_snapshot) AS x
            WHERE pg_visible_in_snapshot(x, pg_current_snapshot())))
        ORDER BY txid LIMIT 1) IS NOT NULL
    AS rows_waiting

-- want_wakeups --
-- An idle relay asks for NOTIFYs, then looks for rows, in one round trip.  The
-- outbox trigger notifies only while someone holds this lock (schema 0005): an
-- application commit the look missed (its INSERT ran before the lock was taken)
-- is found by the relay's next polls (``Relay._wait_for_work``).  The look is
-- ``rows_waiting``'s statement, composed in (``outbox.db.queries``).
SELECT pg_try_advisory_lock_shared(%(lock_class)s, %(relid)s) AS listening,
       ({rows_waiting}) AS rows_waiting

-- stop_wanting_wakeups --
-- A busy relay claims until the outbox is empty: commits meanwhile need not notify.
SELECT pg_advisory_unlock_shared(%(lock_class)s, %(relid)s) AS released

-- outbox_relid --
SELECT %(name)s::regclass::oid::integer AS relid

-- unregister_relay --
DELETE FROM {relays} WHERE relay_id = %(relay_id)s

-- relay_liveness --
-- For each relay id: is its control session alive (advisory lock held), and how
-- old is its last heartbeat.  Unknown ids come back with lock_held = false.
-- `server_age`: when the relay's last heartbeat is older than this server's start
-- (a restart) or than the last transaction it replayed as a standby (a promotion;
-- the heartbeat replicated, both times are the old primary's clock), its session
-- ended with the server, not with the relay: seconds since the server took over,
-- the time the relay has had to take its id back (``resolver/decide.py``).  NULL
-- when the heartbeat was written on this server as it runs now.
SELECT ids.relay_id,
       l.pid AS backend_pid,
       r.hostname, r.pid, r.started_at,
       extract(epoch FROM now() - r.heartbeat_at)::float8 AS heartbeat_age,
       CASE WHEN r.heartbeat_at <= s.took_over
            THEN extract(epoch FROM now() - s.took_over)::float8 END AS server_age
FROM unnest(%(relay_ids)s::text[], %(lock_keys)s::int[]) AS ids(relay_id, lock_key)
CROSS JOIN (SELECT greatest(pg_postmaster_start_time(), pg_last_xact_replay_timestamp())
                   AS took_over) s
LEFT JOIN {relays} r ON r.relay_id = ids.relay_id
LEFT JOIN pg_locks l
       ON l.locktype = 'advisory' AND l.granted
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND l.classid = %(lock_class)s::int::oid
      AND l.objid = ids.lock_key::oid
      AND l.objsubid = 2

-- live_relays --
SELECT r.relay_id, r.hostname, r.pid, r.started_at,
       extract(epoch FROM now() - r.heartbeat_at)::float8 AS heartbeat_age,
       l.pid IS NOT NULL AS alive
FROM {relays} r
LEFT JOIN pg_locks l
       ON l.locktype = 'advisory' AND l.granted
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND l.classid = %(lock_class)s::int::oid
      AND l.objid = r.lock_key::oid
      AND l.objsubid = 2
ORDER BY r.started_at

-- forget_dead_relays --
-- Registry rows of relays whose session is gone and that own no prepared batch.
DELETE FROM {relays} r
WHERE r.heartbeat_at < now() - make_interval(secs => %(older_than)s)
  AND NOT EXISTS (
      SELECT 1 FROM pg_locks l
      WHERE l.locktype = 'advisory' AND l.granted
        AND l.classid = %(lock_class)s::int::oid AND l.objid = r.lock_key::oid
        AND l.objsubid = 2)
  AND NOT EXISTS (
      SELECT 1 FROM pg_prepared_xacts p WHERE p.gid LIKE %(gid_prefix)s || r.relay_id || ':%%')

-- orphaned_batches --
-- How many prepared batches of this table no live relay answers for: their relay's
-- lock (``try_lock_relay``, in this database) is not held, or its heartbeat is older
-- than %(relay_timeout)s.  A dormant relay looks every resolve_interval on its
-- wake-up session and wakes to resolve them (``outbox.relay.process``).
SELECT count(*)::int AS batches
FROM pg_prepared_xacts p
WHERE p.database = current_database() AND p.gid LIKE %(gid_prefix)s || '%%'
  AND (NOT EXISTS (
          SELECT 1 FROM pg_locks l
          WHERE l.locktype = 'advisory' AND l.granted
            AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
            AND l.classid = %(lock_class)s::int::oid
            AND l.objid = ((('x' || substr(split_part(p.gid, ':', 3), 1, 8))::bit(32)::int)
                           & 2147483647)::oid
            AND l.objsubid = 2)
       OR EXISTS (
          SELECT 1 FROM {relays} r
          WHERE r.relay_id = split_part(p.gid, ':', 3)
            AND r.heartbeat_at < now() - make_interval(secs => %(relay_timeout)s)))

-- dormant_look --
-- A dormant relay's look (``outbox.relay.process``), one round trip: rows where its
-- claims look (``rows_waiting``) and the prepared batches no live relay answers for
-- (``orphaned_batches``).
SELECT ({rows_waiting}) AS rows_waiting, ({orphaned_batches}) AS batches

-- front_rows --
-- The rows of the outbox (id, created_at), found where the relays' claims look
-- (``outbox/db/front.py``; %(low_water)s etc.: the front they saved): from W on,
-- and below it the late ids and the rows inserted by transactions the front's
-- snapshot did not see.  By the front's invariant that is every row that exists but
-- one whose txid the application wrote, below W, until a relay's safety net finds
-- it.  No walk over the dead rows below W.  With no front (W the bottom, no
-- snapshot) every row, from the lowest id.  The sweep is MATERIALIZED, without
-- a condition on id, as in ``claim_batch``.  Composed into ``backlog`` (and so
-- ``chart_sample`` and ``metrics_snapshot``; ``outbox.db.queries``).
WITH swept AS MATERIALIZED (
    SELECT id, created_at FROM {outbox} WHERE txid >= pg_snapshot_xmax(%(seen)s::pg_snapshot)
    UNION ALL
    SELECT id, created_at FROM {outbox}
    WHERE txid = ANY (ARRAY (SELECT pg_snapshot_xip(%(seen)s::pg_snapshot)))
), late AS MATERIALIZED (
    SELECT id, created_at FROM {outbox} WHERE id = ANY (%(late)s::bigint[])
)
SELECT id, created_at FROM {outbox} WHERE id >= %(low_water)s
UNION ALL
(SELECT id, created_at FROM swept WHERE id < %(low_water)s
 UNION
 SELECT id, created_at FROM late WHERE id < %(low_water)s)

-- backlog --
-- An application may commit created_at = '-infinity' (the relay dead-letters such a
-- row); subtracting it is out of range, so ages skip non-finite timestamps.  The
-- rows as the relays' claims see them (``front_rows``).
SELECT count(*) AS rows,
       coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE isfinite(created_at))),
                0)::float8 AS oldest_age_seconds
FROM ({front_rows}) AS backlog

-- scaler_backlog --
-- The backlog as one statement with no parameter, for an autoscaler that polls it
-- (KEDA's postgresql scaler: deploy/kubernetes/overlays/keda/scaledobjects.yaml
-- holds this statement for the table `outbox`; `tests/unit/test_deploy.py` keeps
-- the two the same).  ``backlog``'s count over the same ``front_rows``, whose
-- parameters are read here from the front the relays saved, under the checks of
-- ``front.resumed``: this cluster, timeline and file of the outbox, a snapshot not
-- ahead of this server's; otherwise from the lowest id, as a relay's first claim.
-- Only a count: the scaler reads the first column of the first row.  Run it as a
-- role with the claim's planner settings (``PINNED_CLAIM_PLAN``, set with ALTER
-- ROLE: a statement cannot set its own): tests/integration/db/test_scaler_backlog.py
-- pins the plan.
WITH saved AS MATERIALIZED (
    SELECT f.low_water, f.late, f.seen
    FROM {claim_front} AS f
    CROSS JOIN pg_control_system() AS s
    CROSS JOIN pg_control_checkpoint() AS c
    WHERE f.low_water IS NOT NULL AND f.seen IS NOT NULL
      AND f.system_identifier = s.system_identifier AND f.timeline = c.timeline_id
      AND f.filenode = pg_relation_filenode(to_regclass({outbox_name}))
      AND pg_snapshot_xmax(f.seen)::text::bigint
          <= pg_snapshot_xmax(pg_current_snapshot())::text::bigint
), front AS MATERIALIZED (
    SELECT coalesce(saved.low_water, '-9223372036854775808'::bigint) AS low_water,
           coalesce(saved.late, '{{}}'::bigint[]) AS late, saved.seen
    FROM (VALUES (1)) AS one (n) LEFT JOIN saved ON true
)
SELECT count(*) AS backlog_rows FROM ({front_rows_saved}) AS backlog

-- dead_letter_count --
-- With ordering keys: how many keys have a dead letter (with
-- ordering_dead_letters = block, each of them is held back).
SELECT count(*) AS dead_letters, count(DISTINCT ordering_key) AS ordering_keys
FROM {dead_letters}

-- list_dead_letters --
-- created_at as text: a dead letter may hold a value Python cannot (infinity).  Text
-- cut at %(chars)s characters (the reason's length in reason_chars): a routing key
-- too long to publish is a reason to be a dead letter, and the list stays bounded by
-- its --limit whatever a row holds.
SELECT id, message_id, left(exchange, %(chars)s) AS exchange,
       left(routing_key, %(chars)s) AS routing_key,
       left(ordering_key, %(chars)s) AS ordering_key, left(reason, %(chars)s) AS reason,
       length(reason) AS reason_chars, attempts, gid, left(content_type, %(chars)s) AS content_type,
       octet_length(payload) AS payload_bytes, created_at::text AS created_at, failed_at
FROM {dead_letters}
ORDER BY failed_at, id
LIMIT %(limit)s

-- dead_letter --
-- One dead letter, for a detail view: the first %(most)s bytes of its payload (a
-- message too large to publish is a dead letter of up to 1 GB) and their total.
-- headers and created_at as text: a dead letter may hold a value Python cannot load
-- (that may be why it is one).
SELECT id, message_id, exchange, routing_key, ordering_key, reason, attempts, gid, content_type,
       substring(payload FROM 1 FOR %(most)s) AS payload, octet_length(payload) AS payload_bytes,
       left(headers::text, %(most)s) AS headers, length(headers::text) AS headers_chars,
       created_at::text AS created_at, failed_at
FROM {dead_letters}
WHERE id = %(row_id)s

-- dead_letter_value --
-- The whole payload or headers of one dead letter, for a download: the value only
-- if it has at most %(most)s bytes, and its size.
SELECT CASE WHEN octet_length(v.value) <= %(most)s THEN v.value END AS value,
       octet_length(v.value) AS size
FROM {dead_letters} d,
     LATERAL (SELECT CASE WHEN %(what)s = 'payload' THEN d.payload
                          ELSE convert_to(d.headers::text, 'UTF8') END AS value) v
WHERE d.id = %(row_id)s

-- search_dead_letters --
-- A page of the console's list: every dead letter whose row id is %(q)s, or whose
-- message id, reason, exchange, routing key or ordering key contains it (%(like)s,
-- case-insensitive), over the whole table, oldest failure first, with the total.
-- A substring search cannot use a B-tree: it reads the table (5,000 rows: a few ms).
-- Text cut at %(chars)s characters as in list_dead_letters.
SELECT id, message_id, left(exchange, %(chars)s) AS exchange,
       left(routing_key, %(chars)s) AS routing_key,
       left(ordering_key, %(chars)s) AS ordering_key, left(reason, %(chars)s) AS reason,
       length(reason) AS reason_chars, attempts, gid, left(content_type, %(chars)s) AS content_type,
       octet_length(payload) AS payload_bytes, created_at::text AS created_at, failed_at,
       count(*) OVER () AS total
FROM {dead_letters}
WHERE %(q)s = '' OR id::text = %(q)s OR message_id::text ILIKE %(like)s
   OR reason ILIKE %(like)s OR exchange ILIKE %(like)s OR routing_key ILIKE %(like)s
   OR ordering_key ILIKE %(like)s
ORDER BY failed_at, id
LIMIT %(limit)s OFFSET %(offset)s

-- dead_letter_groups --
-- The same dead letters by reason, or by ordering key (%(by)s), biggest group first;
-- each group is named by one of its rows (first_id), never by its text, in a link;
-- grouped by the whole text, shown cut at %(chars)s characters.
SELECT left(label, %(chars)s) AS label, length(label) AS label_chars, count(*) AS count,
       min(failed_at) AS oldest, min(id) AS first_id
FROM (
    SELECT CASE WHEN %(by)s = 'reason' THEN reason ELSE ordering_key END AS label, failed_at, id
    FROM {dead_letters}
    WHERE (%(q)s = '' OR id::text = %(q)s OR message_id::text ILIKE %(like)s
           OR reason ILIKE %(like)s OR exchange ILIKE %(like)s OR routing_key ILIKE %(like)s
           OR ordering_key ILIKE %(like)s)
      AND (%(by)s = 'reason' OR ordering_key IS NOT NULL)
) AS matching
GROUP BY matching.label
ORDER BY count(*) DESC, min(failed_at), min(id)
LIMIT %(limit)s

-- dead_letters_sharing_reason --
-- The oldest %(limit)s dead letters with the reason of row %(row_id)s (a group
-- action takes a page at a time).
SELECT id FROM {dead_letters}
WHERE reason = (SELECT reason FROM {dead_letters} WHERE id = %(row_id)s)
ORDER BY failed_at, id
LIMIT %(limit)s

-- dead_letter_keys --
-- The ordering keys of these dead letters.
SELECT DISTINCT ordering_key FROM {dead_letters}
WHERE id = ANY(%(row_ids)s::bigint[]) AND ordering_key IS NOT NULL

-- select_dead_letters --
-- What retry_dead_letters and purge_dead_letters (without --older-than) take for the
-- same selection, read without changing anything: the console shows it before the
-- operator confirms.  The WHERE clause must stay theirs (a test compares them).
SELECT id, message_id, ordering_key, reason, failed_at
FROM {dead_letters}
WHERE %(all)s OR message_id = ANY(%(ids)s::uuid[]) OR id = ANY(%(row_ids)s::bigint[])
   OR ordering_key = ANY(%(keys)s::text[])
ORDER BY id
LIMIT %(limit)s

-- held_dead_letters --
-- The dead letters of a selection that an in-doubt batch holds, with its gid: a
-- prepared transaction that deleted the row's id from the outbox (a retry inserting
-- that id again would wait for it: Lock/transactionid) or that changed the dead letter
-- itself.  A row the batch deleted is still visible to others, with the batch's xid
-- as its xmax.  Read before a console action, so it says so instead of waiting.
SELECT d.id, p.gid
FROM {dead_letters} d
JOIN {outbox} o ON o.id = d.id
JOIN pg_prepared_xacts p ON p.transaction = o.xmax AND p.database = current_database()
WHERE %(into_outbox)s
  AND (d.id = ANY(%(row_ids)s::bigint[]) OR d.ordering_key = ANY(%(keys)s::text[]))
UNION
SELECT d.id, p.gid
FROM {dead_letters} d
JOIN pg_prepared_xacts p ON p.transaction = d.xmax AND p.database = current_database()
WHERE d.id = ANY(%(row_ids)s::bigint[]) OR d.ordering_key = ANY(%(keys)s::text[])
ORDER BY gid, id

-- retry_dead_letters --
-- One statement, so one transaction: a dead letter is either still here or back in
-- the outbox (same row id, message_id and created_at), never both and never neither.
-- A row dead-lettered by a batch that was then rolled back is in both tables: the
-- retry only drops the dead letter (ON CONFLICT DO NOTHING).  Selected by
-- message_id (every row carrying it), by row id or by ordering key (every dead
-- letter of the key: they return in their original order, as their ids are kept).
-- The insert fires the wake-up trigger, so idle relays pick the rows up at once.
WITH moved AS (
    DELETE FROM {dead_letters}
    WHERE %(all)s OR message_id = ANY(%(ids)s::uuid[]) OR id = ANY(%(row_ids)s::bigint[])
       OR ordering_key = ANY(%(keys)s::text[])
    RETURNING id, message_id, exchange, routing_key, payload, headers, content_type, created_at,
              ordering_key
), restored AS (
    INSERT INTO {outbox}
        (id, message_id, exchange, routing_key, payload, headers, content_type, created_at,
         ordering_key)
    OVERRIDING SYSTEM VALUE
    SELECT id, message_id, exchange, routing_key, payload, headers, content_type, created_at,
           ordering_key
    FROM moved
    ON CONFLICT (id) DO NOTHING
)
SELECT id, message_id, ordering_key FROM moved

-- purge_dead_letters --
DELETE FROM {dead_letters}
WHERE (%(all)s OR message_id = ANY(%(ids)s::uuid[]) OR id = ANY(%(row_ids)s::bigint[])
       OR ordering_key = ANY(%(keys)s::text[]))
  AND (%(older_than)s::float8 IS NULL
       OR failed_at < now() - make_interval(secs => %(older_than)s::float8))
RETURNING id, message_id, ordering_key

-- metrics_snapshot --
-- Everything the metrics endpoint reads from the database, in one round trip.  The
-- backlog and its oldest row's age are ``backlog``'s, as ``outbox status`` and the
-- console's charts count them: where the relays' claims look (``front_rows``), not
-- over the dead rows below their front.
SELECT b.rows AS backlog_rows,
       b.oldest_age_seconds AS oldest_row_age_seconds,
       (SELECT count(*) FROM pg_prepared_xacts
        WHERE database = current_database() AND starts_with(gid, %(gid_prefix)s)) AS prepared_batches,
       coalesce((SELECT extract(epoch FROM now() - min(prepared)) FROM pg_prepared_xacts
                 WHERE database = current_database() AND starts_with(gid, %(gid_prefix)s)), 0)::float8
           AS oldest_prepared_age_seconds,
       (SELECT count(*) FROM {dead_letters}) AS dead_letters,
       (SELECT count(DISTINCT ordering_key) FROM {dead_letters}) AS dead_letter_ordering_keys,
       (SELECT count(*) FROM {relays} r
        JOIN pg_locks l
          ON l.locktype = 'advisory' AND l.granted
         AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
         AND l.classid = %(lock_class)s::int::oid
         AND l.objid = r.lock_key::oid
         AND l.objsubid = 2) AS live_relays
FROM ({backlog}) AS b

-- chart_sample --
-- What the console's charts sample from one outbox table, in one round trip: the
-- backlog and its oldest row's age, as ``outbox status`` counts them (``backlog``:
-- where the relays' claims look, from their saved front; ``count(*)`` and the
-- lowest id read every dead row a held horizon keeps, every 10 s: 14,851 blocks
-- behind 200,000 dead rows, tests/integration/web/test_sampler.py), and two
-- counters of the statistics system (which the server keeps anyway): rows ever
-- deleted from the outbox (published or dead-lettered) and rows ever inserted into
-- the dead letters.  Their differences between two samples are what was published
-- and dead-lettered in between.  And the MVCC horizon (``horizon.sql``): the
-- outbox's dead rows, and for how long the oldest transaction of this database, a
-- session's or a prepared one, has held its snapshot (as
-- ``outbox_horizon_age_seconds``; bounded by max_connections and
-- max_prepared_transactions).
SELECT b.rows AS backlog,
       b.oldest_age_seconds AS oldest_seconds,
       coalesce((SELECT n_tup_del FROM pg_stat_user_tables
                 WHERE relid = to_regclass(%(outbox)s)), 0) AS deleted,
       coalesce((SELECT n_tup_ins FROM pg_stat_user_tables
                 WHERE relid = to_regclass(%(dead_letters)s)), 0) AS dead_lettered,
       coalesce((SELECT n_dead_tup FROM pg_stat_user_tables
                 WHERE relid = to_regclass(%(outbox)s)), 0) AS dead_rows,
       coalesce(greatest(
           (SELECT max(extract(epoch FROM now() - xact_start)) FROM pg_stat_activity
            WHERE (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
              AND pid <> pg_backend_pid()
              AND (datname = current_database() OR datid IS NULL
                   OR current_setting('server_version_num')::int < 140000)),
           (SELECT max(extract(epoch FROM now() - prepared)) FROM pg_prepared_xacts
            WHERE database = current_database())), 0)::float8 AS horizon_seconds
FROM ({backlog}) AS b

-- table_privileges --
-- Which of the (table, privilege) pairs the current role holds.  A table that does
-- not exist (or is not visible) comes back as not present: the schema check says so.
SELECT wanted.name AS table_name, wanted.privilege,
       to_regclass(wanted.name) IS NOT NULL AS present,
       coalesce(has_table_privilege(to_regclass(wanted.name), wanted.privilege), false)
           AS granted,
       current_user AS role
FROM unnest(%(tables)s::text[], %(privileges)s::text[]) AS wanted(name, privilege)

-- move_due --
-- The relay's mover (schema 0009): the scheduled rows due now, in due order (ties by
-- id), leave {scheduled} and enter the outbox with a new id (in that order) and the
-- mover's txid (the stamp trigger), so the claims treat them as rows just
-- committed.  created_at becomes the due time: the message's AMQP timestamp, and
-- the backlog's age counts from when the row was due, not from when it was
-- scheduled.  One statement in its own transaction, never inside a batch (its
-- INSERT fires the wake-up trigger, whose NOTIFY a prepared transaction cannot
-- hold).  SKIP LOCKED: several relays' movers share the due rows.
-- The scan starts at %(scan_from)s (``outbox.db.scheduled.scan_from``), past the
-- dead index entries of the rows moved before it, which vacuum cannot remove while
-- the MVCC horizon is held.  Also returns this statement's now(), the due time of
-- the last row moved, and the next due time after now (a scan that starts past
-- every row moved: index entries later than now() are rows still waiting).
WITH due AS MATERIALIZED (
    SELECT id FROM {scheduled}
    WHERE deliver_at >= %(scan_from)s::timestamptz AND deliver_at <= now()
    ORDER BY deliver_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), moved AS (
    DELETE FROM {scheduled} WHERE id = ANY (ARRAY (SELECT id FROM due))
    RETURNING id, message_id, exchange, routing_key, payload, headers, content_type,
              ordering_key, deliver_at
), inserted AS (
    INSERT INTO {outbox} (message_id, exchange, routing_key, payload, headers, content_type,
                          created_at, ordering_key, deliver_at)
    SELECT message_id, exchange, routing_key, payload, headers, content_type, deliver_at,
           ordering_key, deliver_at
    FROM moved ORDER BY deliver_at, id
    RETURNING deliver_at
)
SELECT (SELECT count(*) FROM inserted)::integer AS moved,
       (SELECT max(deliver_at) FROM inserted) AS last_due,
       now() AS now,
       (SELECT deliver_at FROM {scheduled} WHERE deliver_at > now()
        ORDER BY deliver_at, id LIMIT 1) AS next_due

-- scheduled_status --
-- The scheduled rows (schema 0009) for ``outbox status`` and the metrics: how many
-- (counted over the due index), seconds until the next is due (NULL: none), and how
-- long the oldest due row has waited to be moved (0: none; no relay runs, or the
-- movers are behind).  Both looks start at now() in the due index: the overdue one
-- walks the moved rows' dead entries too, which a held horizon keeps.
SELECT (SELECT count(*) FROM {scheduled})::bigint AS scheduled_rows,
       extract(epoch FROM (SELECT deliver_at FROM {scheduled} WHERE deliver_at > now()
                           ORDER BY deliver_at, id LIMIT 1) - now())::float8
           AS next_due_seconds,
       coalesce(extract(epoch FROM now() - (SELECT deliver_at FROM {scheduled}
                                            WHERE deliver_at <= now()
                                            ORDER BY deliver_at, id LIMIT 1)), 0)::float8
           AS overdue_seconds
