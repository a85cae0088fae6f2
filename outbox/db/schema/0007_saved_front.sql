-- 0007: a relay's new session starts where the claims before it got (issue 33).
-- A claim starts at a low-water mark and finds the rows committed behind it by
-- their txid (0006, ``outbox/db/front.py``), but a new session (every start and
-- reconnect of a relay) had no mark and walked every dead row from the lowest id:
-- 5 to 7 s at 5 million dead rows while the MVCC horizon was held.  A front stays
-- valid once computed, so the relays save one here (at most every few seconds,
-- outside their claims) and a new session starts from the freshest, if it was
-- saved on this cluster and timeline, for this very outbox table (`filenode`: a
-- table restored from a dump, or truncated and reloaded, holds rows with txids
-- copied from elsewhere).  One row per outbox table (`slot` is always true): a
-- relay never replaces a fresher front with an older one.
-- Online: a new table, nothing on the outbox is locked.
CREATE TABLE IF NOT EXISTS {claim_front} (
    slot boolean PRIMARY KEY DEFAULT true CHECK (slot),
    low_water bigint NOT NULL,
    late bigint[] NOT NULL,
    seen pg_snapshot NOT NULL,
    system_identifier bigint NOT NULL,
    timeline integer NOT NULL,
    filenode oid NOT NULL,
    saved_at timestamptz NOT NULL DEFAULT now()
);
-- The roles that may already claim (DELETE on the outbox: the relays) may save and
-- read the front, and those that may read the outbox (`outbox status`) may read it:
-- an upgrade needs no GRANT of its own, and no relay of 0.6 is refused at start.
-- The outbox's owner too, if another role runs this (its rights are implicit: its
-- ACL may be empty), for a relay that runs as the role that created the outbox.
DO $grants$
DECLARE
    grantee oid;
BEGIN
    FOR grantee IN
        SELECT DISTINCT a.grantee FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = '{outbox}'::regclass AND a.privilege_type = 'DELETE'
          AND a.grantee NOT IN (0, c.relowner)
        UNION
        SELECT c.relowner FROM pg_class c
        WHERE c.oid = '{outbox}'::regclass
          AND c.relowner <> (SELECT relowner FROM pg_class WHERE oid = '{claim_front}'::regclass)
    LOOP
        EXECUTE format('GRANT SELECT, INSERT, UPDATE ON {claim_front} TO %s', grantee::regrole);
    END LOOP;
    FOR grantee IN
        SELECT DISTINCT a.grantee FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = '{outbox}'::regclass AND a.privilege_type = 'SELECT'
          AND a.grantee NOT IN (0, c.relowner)
    LOOP
        EXECUTE format('GRANT SELECT ON {claim_front} TO %s', grantee::regrole);
    END LOOP;
END
$grants$;
