"""Adversary: the saved claim front (``outbox.db.front``, "A new session") across a
rewrite of the outbox table while a relay's session runs on."""

from __future__ import annotations

import psycopg

from outbox.db.batches import BatchStore
from tests.integration.db.test_claim_front import BATCH, _commit, _insert


def _store(dsn: str) -> BatchStore:
    return BatchStore(dsn, "outbox", statement_timeout=60)


def test_save__a_session_older_than_a_truncate_and_reload_does_not_vouch_for_the_new_file(
    dsn: str,
) -> None:
    """The outbox truncated and reloaded from a copy (its rows keep the txids the
    copy holds) while a relay's session runs: that session's next save of its
    front, computed on the old file, must not be stamped with the new file's
    filenode (new sessions would trust it and leave the reloaded rows behind W
    until the safety net, up to 15 minutes).  The session starts again from the
    bottom instead, and so does the next one.  Before, the save stamped the
    filenode current at the save, and neither claimed the reloaded rows."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        early = _insert(conn, 5)
        conn.execute("CREATE TABLE outbox_copy AS SELECT * FROM outbox")
        _insert(conn, 1)  # a row after them: the front moves past them to it
    before = _store(dsn)
    try:
        assert [r.id for r in before.claim_batch(len(early))] == early
        _commit(before, "early")
        before.claim_batch(BATCH)  # its front is now past the copied rows
        before.abandon_claim()
        before.save_front()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("TRUNCATE outbox")
            conn.execute("INSERT INTO outbox OVERRIDING SYSTEM VALUE SELECT * FROM outbox_copy")
        before.claim_batch(BATCH)  # a claim after the reload: its front moves on
        before.abandon_claim()
        before.save_front()  # its timer's next save
        assert [r.id for r in before.claim_batch(BATCH)] == early
        before.abandon_claim()
    finally:
        before.close()
    after = _store(dsn)
    try:
        assert [r.id for r in after.claim_batch(BATCH)] == early
        after.abandon_claim()
    finally:
        after.close()
