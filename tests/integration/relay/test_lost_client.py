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
import os
import signal
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
    both_modes,
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


def commit_stalls(server_dsn: str) -> bool:
    """Whether a commit now waits for a synchronous standby (seen waiting in
    pg_stat_activity, then cancelled), or returns at once.  No statement_timeout
    can tell: a commit's wait runs after it is disabled."""
    with (
        psycopg.connect(server_dsn, autocommit=True) as probe,
        psycopg.connect(server_dsn, autocommit=True) as watcher,
    ):
        pid = probe.info.backend_pid
        done = threading.Event()

        def commit() -> None:
            with probe.transaction():  # an xid and a WAL record: it waits if any commit does
                probe.execute("SELECT pg_logical_emit_message(true, 'outbox-test', '')")
            done.set()

        thread = threading.Thread(target=commit)
        thread.start()
        try:
            while not done.wait(0.01):
                row = watcher.execute(
                    "SELECT wait_event = 'SyncRep' FROM pg_stat_activity WHERE pid = %s", [pid]
                ).fetchone()
                if row and row[0]:
                    return True
            return False
        finally:
            if not done.is_set():
                watcher.execute("SELECT pg_cancel_backend(%s)", [pid])
            thread.join()


def set_standby(server_dsn: str, name: str | None) -> None:
    """Name a synchronous standby that never answers (``None``: none), and wait until
    commits stall on it (or no longer do; the waiters are then released)."""
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        if name is None:
            conn.execute("ALTER SYSTEM RESET synchronous_standby_names")
        else:
            conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{name}'")
        conn.execute("SELECT pg_reload_conf()")
    wait_for(
        lambda: commit_stalls(server_dsn) == (name is not None),
        10,
        f"commits to {'stall' if name else 'no longer stall'} on a synchronous standby",
    )


@contextlib.contextmanager
def standby_never_answers(server_dsn: str) -> Iterator[None]:
    """Every commit and PREPARE waits for a synchronous standby that is not there
    (each after it is durable here and, for a PREPARE, listed as prepared)."""
    set_standby(server_dsn, "ghost")
    try:
        yield
    finally:
        set_standby(server_dsn, None)


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
    lost = BatchStore(settings.dsn, settings.table, note_backend=True)
    bystander = BatchStore(settings.dsn, settings.table, note_backend=True)
    store = BatchStore(settings.dsn, settings.table, note_backend=True)
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


# -- the cut-off statement's backend, caught inside its wait ----------------------------
@dataclasses.dataclass
class Orphan:
    """Cut the relay off at ``statement`` while its backend waits for the standby.

    The standby stalls commits from just before that statement reaches the server;
    the client is cut only once the backend waits inside it (after its PREPARE is
    listed, or after its COMMIT PREPARED is durable), so the cut always finds the gid
    held.  ``stop``: the backend is then stopped (SIGSTOP), as if stuck in I/O, so
    that it cannot end when told to.
    """

    server_dsn: str
    statement: bytes
    stop: bool = False
    pid: int = 0
    gid: str = ""

    def arm(self, proxy: TcpProxy, *, skip: int = 0) -> None:
        proxy.arm(self.statement, skip=skip, orphan=True, before=self._stall, after=self._caught)

    def _stall(self) -> None:
        set_standby(self.server_dsn, "ghost")

    def _caught(self) -> None:
        self.pid, self.gid = wait_for(
            lambda: waiting_for_standby(self.server_dsn, self.statement.decode()),
            10,
            f"{self.statement.decode()} to wait for the standby",
        )
        if self.stop:
            os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.stop and self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)

    def running(self) -> bool:
        with psycopg.connect(self.server_dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [self.pid]
            ).fetchone()
        return bool(row and row[0])


def waiting_for_standby(server_dsn: str, statement: str) -> tuple[int, str] | None:
    """(pid, gid) of the backend running ``statement`` while it waits for the standby."""
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT pid, substring(query FROM $$'(obx:[^']+)'$$) FROM pg_stat_activity "
            "WHERE wait_event = 'SyncRep' AND query LIKE %s",
            [f"{statement} %"],
        ).fetchone()
    return (int(row[0]), str(row[1])) if row else None


def start(relay: Relay) -> threading.Thread:
    thread = threading.Thread(target=relay.run, kwargs={"drain": True}, daemon=True)
    thread.start()
    return thread


def joined(relay: Relay, thread: threading.Thread, dsn: str, timeout: float = 60) -> None:
    thread.join(timeout=timeout)
    if thread.is_alive():
        relay.stop.set()
        thread.join(timeout=30)
        pytest.fail(f"the relay did not drain the outbox: {prepared_left(dsn)}")


@contextlib.contextmanager
def orphaned(relay: Relay, orphan: Orphan, proxy: TcpProxy) -> Iterator[None]:
    """Arm the cut, start ``relay`` (``start``) and, whatever happens, disarm, resume
    the lost backend, stop the relay and bring the standby back."""
    try:
        relay.start()
        yield
    finally:
        proxy.disarm()
        orphan.resume()
        relay.stop.set()
        set_standby(orphan.server_dsn, None)


def test_pipelined_prepare_cut_while_the_batch_before_is_published(
    pg_server: str, settings: Settings, topology: Topology, pg_proxy: TcpProxy
) -> None:
    """Depth 2: the second batch's PREPARE is cut off while the first is published
    (kept: it survives a database failure).  The lost backend is ended, the second
    batch rolled back, the first committed: no duplicate."""
    committed = insert_rows(settings.dsn, topology.exchange, ROWS)
    relay = Relay(
        dataclasses.replace(
            settings, dsn=proxied_dsn(settings.dsn, pg_proxy), batch_size=BATCH, pipeline=True
        )
    )
    orphan = Orphan(pg_server, b"PREPARE TRANSACTION")
    with orphaned(relay, orphan, pg_proxy):
        orphan.arm(pg_proxy, skip=1)
        thread = start(relay)
        assert pg_proxy.triggered.wait(20), "the relay never sent a second PREPARE"
        # Before, nothing ended it: it held the gid as long as the standby was missing,
        # and the relay had taken "busy" for "finished elsewhere".
        wait_for(lambda: not orphan.running(), 20, "the relay to end its lost backend")
        set_standby(pg_server, None)
        joined(relay, thread, settings.dsn)

    assert relay.stats.batches_rolled_back == 1
    assert relay.stats.messages_published == ROWS
    check_delivery(settings.dsn, topology, committed, max_duplicates=0)


@both_modes
def test_commit_prepared_still_running_after_the_cut_is_ended_committed(
    pg_server: str, settings: Settings, topology: Topology, pg_proxy: TcpProxy
) -> None:
    """A COMMIT PREPARED waits for the standby after its commit is durable, still
    listing and holding its gid.  Ended by the relay inside that wait, it completes:
    the batch is committed once, never rolled back, its gid no longer held."""
    committed = insert_rows(settings.dsn, topology.exchange, ROWS)
    relay = Relay(
        dataclasses.replace(settings, dsn=proxied_dsn(settings.dsn, pg_proxy), batch_size=BATCH)
    )
    orphan = Orphan(pg_server, b"COMMIT PREPARED")
    with orphaned(relay, orphan, pg_proxy):
        orphan.arm(pg_proxy)
        thread = start(relay)
        assert pg_proxy.triggered.wait(20), "the relay never sent a COMMIT PREPARED"
        wait_for(lambda: not orphan.running(), 20, "the relay to end its lost backend")
        assert orphan.gid not in prepared_left(settings.dsn)  # committed, while stalled
        set_standby(pg_server, None)
        joined(relay, thread, settings.dsn)

    assert relay.stats.batches_rolled_back == 0
    assert relay.stats.messages_published == ROWS
    check_delivery(settings.dsn, topology, committed, max_duplicates=0)


def test_a_lost_backend_that_does_not_end_keeps_its_batch_in_doubt(
    pg_server: str, settings: Settings, topology: Topology, pg_proxy: TcpProxy
) -> None:
    """The lost backend cannot end (stopped inside its PREPARE, as if stuck in I/O):
    the relay says so and retries, settling nothing, until it is gone."""
    committed = insert_rows(settings.dsn, topology.exchange, ROWS)
    relay = Relay(
        dataclasses.replace(
            settings,
            dsn=proxied_dsn(settings.dsn, pg_proxy),
            batch_size=BATCH,
            pipeline=False,
            statement_timeout=2.0,  # how long each try waits for it to end
        )
    )
    orphan = Orphan(pg_server, b"PREPARE TRANSACTION", stop=True)
    with orphaned(relay, orphan, pg_proxy):
        orphan.arm(pg_proxy)
        thread = start(relay)
        assert pg_proxy.triggered.wait(20), "the relay never sent a PREPARE"
        wait_for(lambda: "still running" in (relay.stats.last_error or ""), 30, "a retry")
        assert prepared_left(settings.dsn) == [orphan.gid]
        assert relay.batches.in_doubt
        set_standby(pg_server, None)
        orphan.resume()  # it ends now: it was told to
        joined(relay, thread, settings.dsn)

    assert relay.stats.batches_rolled_back == 1
    assert relay.stats.messages_published == ROWS
    check_delivery(settings.dsn, topology, committed, max_duplicates=0)


def test_a_relay_stopped_while_its_lost_backend_runs_on_leaves_its_batch_to_a_resolver(
    pg_server: str, settings: Settings, topology: Topology, pg_proxy: TcpProxy
) -> None:
    """Stopped while its lost backend still holds a gid, the relay exits at once; the
    batch stays prepared, and once that backend is gone a resolver (here the next
    relay's) rolls it back: nothing lost, nothing sent twice."""
    committed = insert_rows(settings.dsn, topology.exchange, ROWS)
    tuned = dataclasses.replace(settings, batch_size=BATCH, pipeline=False, statement_timeout=2.0)
    relay = Relay(dataclasses.replace(tuned, dsn=proxied_dsn(settings.dsn, pg_proxy)))
    orphan = Orphan(pg_server, b"PREPARE TRANSACTION", stop=True)
    try:
        relay.start()
        orphan.arm(pg_proxy)
        thread = start(relay)
        assert pg_proxy.triggered.wait(20), "the relay never sent a PREPARE"
        wait_for(lambda: "still running" in (relay.stats.last_error or ""), 30, "a retry")
        # (A standby that never answers would hold the relay's unregistering commit.)
        set_standby(pg_server, None)
        relay.stop.set()
        thread.join(timeout=30)
        assert not thread.is_alive(), "the relay did not stop"
        assert relay.stats.messages_published == 0
        assert prepared_left(settings.dsn) == [orphan.gid]
        orphan.resume()
        wait_for(lambda: not orphan.running(), 20, "the lost backend to end")
    finally:
        pg_proxy.disarm()
        orphan.resume()
        set_standby(pg_server, None)

    successor = Relay(tuned)
    joined(successor, start(successor), settings.dsn)
    assert successor.stats.batches_resolved == 1
    assert successor.stats.messages_published == ROWS
    check_delivery(settings.dsn, topology, committed, max_duplicates=0)
