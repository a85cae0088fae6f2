"""The committer session (``BatchStore.send_commit`` / ``collect_commit``): libpq's
send and collect straight on the driver's connection, which must stay usable as a
psycopg connection afterwards, whatever the outcome."""

from __future__ import annotations

import time

import psycopg
from psycopg import pq

from outbox.db.batches import BatchStore
from outbox.gid import Gid, new_relay_id
from tests.fixtures.faults import insert_rows, prepared_left


def _prepare(dsn: str, seq: int) -> str:
    """A prepared batch of one row; its gid."""
    insert_rows(dsn, "ex", 1, tag=f"c{seq}")
    store = BatchStore(dsn, "outbox")
    try:
        assert len(store.claim_batch(10)) == 1
        gid = str(Gid("outbox", new_relay_id(), seq))
        store.prepare(gid)
    finally:
        store.close()
    return gid


def test_send_and_collect__commits_and_leaves_the_session_idle_and_usable(dsn: str) -> None:
    committer = BatchStore(dsn, "outbox", statement_timeout=5.0)
    try:
        for seq in (1, 2):
            gid = _prepare(dsn, seq)
            assert committer.send_commit(gid)
            assert committer.collect_commit(gid) is True
            assert gid not in prepared_left(dsn)
            # Every result read: the driver runs ordinary statements again.
            assert committer.conn.info.transaction_status == pq.TransactionStatus.IDLE
            assert not committer.gid_exists(gid)
        # A gid finished elsewhere: False, as ``finish`` says it; still usable.
        assert committer.send_commit(gid)
        assert committer.collect_commit(gid) is False
        assert committer.conn.info.transaction_status == pq.TransactionStatus.IDLE
        row = committer.conn.execute("SELECT 1 AS one").fetchone()
        assert row == {"one": 1}
        assert not committer.broken
    finally:
        committer.close()


def test_send__a_session_the_server_ended_while_idle_sends_nothing(dsn: str) -> None:
    committer = BatchStore(dsn, "outbox", statement_timeout=5.0)
    gid = _prepare(dsn, 1)
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [committer.conn.info.backend_pid])
        time.sleep(0.2)  # the server's error and EOF reach the client's socket
    assert committer.send_commit(gid) is False
    assert committer.broken
    assert gid in prepared_left(dsn), "nothing was sent: the batch is still prepared"
    other = BatchStore(dsn, "outbox")
    try:
        assert other.finish(gid, commit=True)
    finally:
        other.close()
