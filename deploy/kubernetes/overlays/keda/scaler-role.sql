-- The role KEDA's postgresql scaler connects as (scaledobjects.yaml, through the
-- Secret outbox-keda): it reads the outbox and the relays' saved front, nothing
-- else.  Run once as the tables' owner (psql -v ON_ERROR_STOP=1 -f scaler-role.sql),
-- then set the password.  The planner settings are the relays' claim's
-- (outbox.db.batches.PINNED_CLAIM_PLAN): the statement reads indexes from where
-- the relays got, never the whole table, whatever its statistics say.  A
-- statement cannot set them for itself, so the role does.
CREATE ROLE outbox_scaler LOGIN;
GRANT SELECT ON outbox, outbox_claim_front TO outbox_scaler;
ALTER ROLE outbox_scaler SET enable_seqscan = off;
ALTER ROLE outbox_scaler SET enable_bitmapscan = off;
ALTER ROLE outbox_scaler SET jit = off;
ALTER ROLE outbox_scaler SET statement_timeout = '10s';
