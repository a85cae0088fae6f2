"""What one claim costs the relay and its database, counted rather than timed.

At 2,000 commits/s a batch holds a handful of rows, so every round trip and every
planning of the claim is paid per few messages
(docs/benchmarks.md#latency-at-2000-commitss-on-a-churned-table).  The claim
goes out with its BEGIN and planner settings in one round trip, and its plan is
made once per session (a generic plan), not once per claim.  The gid statements
are built without the driver's composition when the gid needs no quoting.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

import psycopg
import pytest

from outbox.db.batches import BatchStore, gid_statement


def _fill(dsn: str, rows: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload) "
            "SELECT 'x', 'k', 'p'::bytea FROM generate_series(1, %s)",
            [rows],
        )


class _CountingProxy:
    """Forwards one client to PostgreSQL and counts the client's round trips: each
    simple Query and each Sync (the end of an extended-protocol exchange, or of a
    pipeline) waits for the server once."""

    def __init__(self, dsn: str) -> None:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
        self.target = (str(info.get("host", "127.0.0.1")), int(info.get("port", 5432)))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.dsn = psycopg.conninfo.make_conninfo(
            dsn, host="127.0.0.1", port=str(self.listener.getsockname()[1]), sslmode="disable"
        )
        self.round_trips = 0
        self._started = False  # the startup message has no type byte
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(self.target)
        threading.Thread(target=self._pump, args=(server, client), daemon=True).start()
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                self._count(data)
                server.sendall(data)

    def _count(self, data: bytes) -> None:
        if not self._started:
            self._started = True
            return
        at = 0
        while at + 5 <= len(data):
            kind, length = data[at : at + 1], struct.unpack("!i", data[at + 1 : at + 5])[0]
            if kind in (b"Q", b"S"):
                self.round_trips += 1
            at += 1 + length

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)


def test_claim__one_round_trip(dsn: str) -> None:
    """One round trip per claim, but the first of a session (which reads the saved
    front first, ``outbox.db.front``)."""
    _fill(dsn, 5)
    proxy = _CountingProxy(dsn)
    store = BatchStore(proxy.dsn, "outbox", statement_timeout=30)
    try:
        before = proxy.round_trips
        assert len(store.claim_batch(100)) == 5
        assert proxy.round_trips - before == 2
        store.abandon_claim()
        before = proxy.round_trips
        rows = store.claim_batch(100)
        assert len(rows) == 5
        assert proxy.round_trips - before == 1
        store.abandon_claim()
    finally:
        store.close()


def test_claim__planned_once_per_session(dsn: str) -> None:
    """After the driver prepares the claim (its 5th run), the server reuses one
    generic plan: ``pg_prepared_statements`` counts generic plans, not custom ones."""
    _fill(dsn, 50)
    store = BatchStore(dsn, "outbox", statement_timeout=30)
    try:
        for _ in range(10):
            assert len(store.claim_batch(1)) == 1
            store.abandon_claim()
        row = store.conn.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
            "WHERE statement LIKE '%%DELETE FROM%%'"
        ).fetchone()
        assert row is not None, "the claim is not a prepared statement"
        assert row["custom_plans"] == 0
        assert row["generic_plans"] >= 5
    finally:
        store.close()


def test_claim__two_round_trips_without_pipeline_mode(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A libpq older than 14 has no pipeline mode: the claim still works, as before."""
    monkeypatch.setattr(psycopg.Pipeline, "is_supported", classmethod(lambda cls: False))
    _fill(dsn, 5)
    proxy = _CountingProxy(dsn)
    store = BatchStore(proxy.dsn, "outbox", statement_timeout=30)
    try:
        assert len(store.claim_batch(100)) == 5  # and the saved front, once
        store.abandon_claim()
        before = proxy.round_trips
        assert len(store.claim_batch(100)) == 5
        assert proxy.round_trips - before == 2
        store.abandon_claim()
    finally:
        store.close()


def test_gid_statements__a_gid_that_needs_quoting_is_quoted(dsn: str) -> None:
    """A gid outside the relay's own format (``outbox.gid``; a resolver may finish
    what it finds) is quoted by the driver, not pasted into the statement."""
    assert (
        gid_statement("COMMIT PREPARED", "obx:outbox:ab12:7")
        == b"COMMIT PREPARED 'obx:outbox:ab12:7'"
    )
    assert not isinstance(gid_statement("COMMIT PREPARED", "obx:it's"), bytes)
    _fill(dsn, 1)
    store = BatchStore(dsn, "outbox", statement_timeout=30)
    try:
        assert len(store.claim_batch(1)) == 1
        store.prepare("obx:it's; a \\ gid")
        assert store.gid_exists("obx:it's; a \\ gid")
        assert store.finish("obx:it's; a \\ gid", commit=False)
        assert not store.finish("obx:it's; a \\ gid", commit=True)  # gone: finished
        assert len(store.claim_batch(1)) == 1  # rolled back: claimable again
        store.abandon_claim()
    finally:
        store.close()


def test_claim__equal_timestamps_load_once_as_one_object(dsn: str) -> None:
    """The rows of one transaction share their ``created_at``: the claim loads it
    once and hands every such row the same object (so the relay converts it to an
    AMQP timestamp once), while each row still gets its own value, whatever runs
    between equal ones (another value, one Python cannot load)."""
    stamps = [
        "2024-05-01 10:00:00+00",
        "2024-05-01 10:00:00+00",
        "2024-05-01 10:00:01+00",
        "2024-05-01 10:00:00+00",
        "infinity",
        "2024-05-01 10:00:00+00",
        "2024-05-01 10:00:00+00",
    ]
    with psycopg.connect(dsn, autocommit=True) as conn:
        for stamp in stamps:
            conn.execute(
                "INSERT INTO outbox (exchange, routing_key, payload, created_at) "
                "VALUES ('x', 'k', 'p', %s)",
                [stamp],
            )
    store = BatchStore(dsn, "outbox", statement_timeout=30)
    try:
        rows = store.claim_batch(100)
        store.abandon_claim()
    finally:
        store.close()
    assert [r.created_at.isoformat() if not r.unloadable else "unloadable" for r in rows] == [
        "2024-05-01T10:00:00+00:00",
        "2024-05-01T10:00:00+00:00",
        "2024-05-01T10:00:01+00:00",
        "2024-05-01T10:00:00+00:00",
        "unloadable",
        "2024-05-01T10:00:00+00:00",
        "2024-05-01T10:00:00+00:00",
    ]
    assert rows[4].unloadable["created_at"].text == "infinity"
    assert rows[0].created_at is rows[1].created_at
    assert rows[5].created_at is rows[6].created_at
