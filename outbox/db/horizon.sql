-- What holds the MVCC horizon back, and what it costs the outbox (``outbox.db.horizon``).
-- Placeholders in braces are identifiers filled in by ``outbox.db.queries``.

-- horizon_sessions --
-- Sessions whose snapshot (backend_xmin) or transaction id (backend_xid) keeps dead
-- rows alive, oldest first.  Since PostgreSQL 14 a session of another database holds
-- only the shared catalogs back, not this database's tables; a walsender (no
-- database) holds every database when its standby sends hot_standby_feedback.  A
-- session of another role shows NULL here unless this role has pg_read_all_stats:
-- those are counted apart (hidden).  Autovacuum workers are left out: VACUUM ignores
-- the xmin of other vacuums, and a worker holds its snapshot only for one table.
SELECT pid, application_name, state, usename AS role, datname AS database,
       backend_type, client_addr::text AS client_addr,
       greatest(age(backend_xmin), age(backend_xid))::bigint AS xmin_age_xids,
       extract(epoch FROM now() - xact_start)::float8 AS xact_age_seconds,
       extract(epoch FROM now() - state_change)::float8 AS state_age_seconds,
       left(query, 200) AS query
FROM pg_stat_activity
WHERE (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
  AND pid <> pg_backend_pid()
  AND backend_type <> 'autovacuum worker'
  AND (datname = current_database() OR datid IS NULL
       OR current_setting('server_version_num')::int < 140000)
ORDER BY greatest(age(backend_xmin), age(backend_xid)) DESC
LIMIT %(limit)s

-- horizon_hidden_sessions --
-- Sessions of other roles whose xmin this role may not see (no pg_read_all_stats).
SELECT count(*) AS hidden
FROM pg_stat_activity
WHERE state IS NULL AND backend_type = 'client backend' AND pid <> pg_backend_pid()

-- horizon_slots --
-- Replication slots that hold a horizon: xmin holds every table (a physical slot fed
-- by a standby's hot_standby_feedback), catalog_xmin only the system catalogs (every
-- logical slot): that one bloats pg_catalog, not the outbox.
SELECT slot_name, slot_type, database, active, active_pid,
       age(xmin)::bigint AS xmin_age_xids, age(catalog_xmin)::bigint AS catalog_xmin_age_xids
FROM pg_replication_slots
WHERE xmin IS NOT NULL OR catalog_xmin IS NOT NULL
ORDER BY greatest(age(xmin), age(catalog_xmin)) DESC
LIMIT %(limit)s

-- horizon_prepared --
-- Prepared transactions of this database, oldest first: each holds the horizon
-- until it is committed or rolled back, across restarts.
SELECT gid, owner, database, age(transaction)::bigint AS xmin_age_xids,
       extract(epoch FROM now() - prepared)::float8 AS age_seconds
FROM pg_prepared_xacts
WHERE database = current_database()
ORDER BY prepared
LIMIT %(limit)s

-- outbox_dead_rows --
-- The outbox's dead rows (as of the statistics, flushed about once a second) and its
-- size on disk with its indexes.
SELECT s.n_dead_tup::bigint AS dead_rows, s.n_live_tup::bigint AS live_rows,
       pg_total_relation_size(s.relid)::bigint AS table_bytes,
       greatest(s.last_autovacuum, s.last_vacuum) AS last_vacuum
FROM pg_stat_user_tables s
WHERE s.relid = to_regclass(%(table)s)
