"""A relay whose work connection is lost while its backend runs on.

A client cut off does not stop its backend.  A PREPARE waiting for a synchronous
standby keeps running after its reply is lost, and its gid is already listed in
``pg_prepared_xacts`` but held ("busy", 55000) by that backend.  Settling the batch
then must wait until that backend is gone: taking "busy" for "finished elsewhere"
left the batch prepared under a live relay, its rows locked until the relay
restarted.

These tests make a standby that never answers (``synchronous_standby_names`` naming
nobody), so they run on a PostgreSQL of their own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from outbox.config import Settings
from outbox.db.batches import BatchStore
from outbox.db.devcluster import PostgresCluster
from outbox.errors import OutcomeUnknown
from outbox.relay.process import Relay
from tests.fixtures.faults import (
    TcpProxy,
    check_delivery,
    insert_rows,
    prepared_left,
    proxied_dsn,
    wait_for,
)
from tests.fixtures.servers import Topology, make_template

BATCH = 10
ROWS = 25
STANDBY_STALLS = 2.0  # seconds the missing standby holds every commit


@pytest.fixture(scope="module")
def pg_server() -> Iterator[str]:
    """A server of this module's own: its synchronous_standby_names is changed."""
    cluster = PostgresCluster(durable=False, max_prepared_transactions=20)
    cluster.start()
    try:
        yield cluster.dsn
    finally:
        cluster.destroy()


@pytest.fixture(scope="module")
def pg_template(pg_server: str) -> str:
    return make_template(pg_server)


@contextlib.contextmanager
def standby_never_answers(server_dsn: str) -> Iterator[None]:
    """Every commit and PREPARE waits for a synchronous standby that is not there
    (each after it is durable here and, for a PREPARE, listed as prepared)."""

    def names(value: str | None) -> None:
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            if value is None:
                conn.execute("ALTER SYSTEM RESET synchronous_standby_names")
            else:
                conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{value}'")
            conn.execute("SELECT pg_reload_conf()")

        def applied() -> bool:
            with psycopg.connect(server_dsn, autocommit=True) as conn:
                row = conn.execute("SHOW synchronous_standby_names").fetchone()
            return row is not None and row[0] == (value or "")

        wait_for(applied, 10, "the reloaded synchronous_standby_names")
        time.sleep(0.3)  # every backend has had its SIGHUP

    names("ghost")
    try:
        yield
    finally:
        names(None)


def test_prepare_still_running_after_the_cut_is_settled_once_its_backend_is_gone(
    pg_server: str, settings: Settings, topology: Topology, pg_proxy: TcpProxy
) -> None:
    committed = insert_rows(settings.dsn, topology.exchange, ROWS)
    proxy = pg_proxy
    relay = Relay(
        dataclasses.replace(
            settings, dsn=proxied_dsn(settings.dsn, proxy), batch_size=BATCH, pipeline=False
        )
    )
    try:
        relay.start()
        thread = threading.Thread(target=relay.run, kwargs={"drain": True})
        with standby_never_answers(pg_server):
            # The first PREPARE reaches the server, which makes it durable, lists it,
            # and waits for the standby; the relay's side of the connection is gone.
            proxy.arm(b"PREPARE TRANSACTION", orphan=True)
            thread.start()
            assert proxy.triggered.wait(10), "the relay never sent a PREPARE"
            time.sleep(STANDBY_STALLS)  # the relay reconnects and settles meanwhile
        thread.join(timeout=60)
        if thread.is_alive():
            relay.stop.set()
            thread.join(timeout=30)
            pytest.fail(f"the relay did not drain the outbox: {prepared_left(settings.dsn)}")
    finally:
        relay.stop.set()

    assert relay.stats.reconnects >= 1
    # The cut-off batch was never published: rolled back once its backend was gone.
    assert relay.stats.batches_rolled_back == 1
    assert relay.stats.messages_published == ROWS
    report = check_delivery(settings.dsn, topology, committed, max_duplicates=0)
    assert report.duplicates == 0


def test_finishing_a_gid_another_session_holds_leaves_it_in_doubt(
    pg_server: str, settings: Settings
) -> None:
    gid = "obx:outbox:held-elsewhere:1"
    store = BatchStore(settings.dsn, settings.table)
    preparing = psycopg.connect(settings.dsn, autocommit=True)
    try:
        with standby_never_answers(pg_server):
            worker = threading.Thread(
                target=preparing.execute,
                args=(f"BEGIN; SELECT 1 FROM outbox FOR UPDATE; PREPARE TRANSACTION '{gid}'",),
            )
            worker.start()
            wait_for(lambda: store.gid_exists(gid), 10, "the PREPARE to be listed")
            # Listed but held by the session still waiting inside its PREPARE.
            with pytest.raises(OutcomeUnknown, match="another session holds it"):
                store.finish(gid, commit=False)
            assert store.gid_exists(gid)
        worker.join(timeout=10)
        assert store.finish(gid, commit=False)
        assert not store.gid_exists(gid)
    finally:
        preparing.close()
        store.close()


def test_end_predecessor_ends_only_the_lost_session_it_names(settings: Settings) -> None:
    lost = BatchStore(settings.dsn, settings.table)
    bystander = BatchStore(settings.dsn, settings.table)
    store = BatchStore(settings.dsn, settings.table)
    try:
        assert lost.backend and bystander.backend and store.backend
        lost.conn.execute("BEGIN")  # holds a claim open, as a cut-off relay would
        lost.conn.execute("SELECT 1 FROM outbox FOR UPDATE")
        # Another process that took the lost one's pid would have another start time.
        impostor = dataclasses.replace(bystander.backend, started=lost.backend.started)
        assert store.end_predecessor(impostor, wait=1.0)
        # Behind a pooler the server process may be this very session's.
        assert store.end_predecessor(store.backend, wait=1.0)

        assert store.end_predecessor(lost.backend, wait=5.0)

        assert _alive(store, bystander) and _alive(store, store)
        assert not _alive(store, lost)
        with pytest.raises(psycopg.OperationalError):
            lost.conn.execute("SELECT 1")
    finally:
        for s in (lost, bystander, store):
            s.close()


def _alive(store: BatchStore, other: BatchStore) -> bool:
    assert other.backend is not None
    row = store.conn.execute(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE pid = %s", [other.backend.pid]
    ).fetchone()
    return bool(row and row["n"])
