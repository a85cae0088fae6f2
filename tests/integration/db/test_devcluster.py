"""The throw-away clusters the suite and ``outbox demo`` / ``outbox bench`` start."""

from __future__ import annotations

import socket

import psycopg

from outbox.db.devcluster import PostgresCluster


def test_cluster__starts_on_another_port_when_its_port_was_taken_meanwhile() -> None:
    """``free_port`` can only say a port was free: suites running side by side may take
    it before the server binds it.  The server then starts on another port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cluster = PostgresCluster(port=port, durable=False)
        try:
            cluster.start()
            assert cluster.port != port
            with psycopg.connect(cluster.dsn, autocommit=True) as conn:
                assert conn.execute("SELECT 1").fetchone() == (1,)
        finally:
            cluster.destroy()
