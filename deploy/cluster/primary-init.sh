#!/bin/sh
# Runs once, when the primary's data directory is created (docker-entrypoint-initdb.d):
# the role the standby streams with, the pg_hba line that lets it, and the standby
# made synchronous.  Synchronous: COMMIT and PREPARE TRANSACTION return only once
# standby1 has the WAL, so a promotion loses no committed row and no prepared batch.
# Set with ALTER SYSTEM, which takes effect when the real server starts: the
# image's set-up server would otherwise wait for a standby that cannot exist yet.
# With one synchronous standby, writes wait while it is down; with two, use
# 'ANY 1 (standby1, standby2)'.
set -eu
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" <<SQL
CREATE ROLE replicator WITH REPLICATION LOGIN PASSWORD '$REPLICATION_PASSWORD';
ALTER SYSTEM SET synchronous_standby_names = 'standby1';
SQL
echo "host replication replicator all scram-sha-256" >> "$PGDATA/pg_hba.conf"
