"""An outage that ends the relay's work session and its control session together.

A server restart or a failover ends every session at once.  The relay learns of
its work session at its next statement, but of its control session (which holds
the advisory lock that proves its relay id alive) only at the heartbeat thread's
next beat, up to ``heartbeat_interval`` later.  Batches prepared meanwhile would
carry a relay id that is already dead, which any resolver may roll back after
their messages went out: a second round of duplicates for one outage.  So a
reopened work session makes the heartbeat thread beat at once
(``Liveness.probe``), and the next batch goes under a new relay id.

Here the interval is long (60 s), so only the probe can explain a new relay id
within seconds.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import psycopg

from outbox.config import Settings
from outbox.gid import parse
from outbox.relay.process import Relay
from tests.fixtures.faults import (
    both_modes,
    check_delivery,
    insert_rows,
    prepared_left,
    rows_left,
    wait_for,
)
from tests.fixtures.servers import Topology


def terminate_relay_sessions(dsn: str) -> int:
    """End every relay session on this test's database (work, control, wake-up
    listener) at once."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name LIKE 'outbox-relay%'"
        ).fetchone()
    assert row is not None
    return int(row[0])


@both_modes
def test_probe__a_control_session_lost_with_the_work_session_is_known_before_the_next_batch(
    settings: Settings, topology: Topology
) -> None:
    s = dataclasses.replace(settings, heartbeat_interval=60.0, relay_timeout=180.0)
    gids: list[tuple[float, str]] = []
    relay = Relay(s, on_batch=lambda gid, _stats: gids.append((time.monotonic(), gid)))
    relay.start()
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    try:
        before = insert_rows(s.dsn, topology.exchange, 20, tag="before")
        wait_for(lambda: rows_left(s.dsn) == 0, 30, "the first rows relayed")
        assert relay.liveness is not None
        old_id = relay.liveness.relay_id
        assert {relay_of(g) for _, g in gids} == {old_id}

        assert terminate_relay_sessions(s.dsn) >= 2  # the work and the control session
        cut = time.monotonic()
        after = insert_rows(s.dsn, topology.exchange, 20, tag="after")
        wait_for(lambda: rows_left(s.dsn) == 0, 30, "the rows written after the outage")
        relayed_after = [relay_of(g) for at, g in gids if at > cut]
        # Every batch after the outage went under a new relay id, long before the
        # heartbeat thread would have beaten on its own.
        assert relayed_after and old_id not in relayed_after, relayed_after
        assert time.monotonic() - cut < s.heartbeat_interval / 2
        assert relay.liveness is not None and relay.liveness.relay_id != old_id
    finally:
        relay.stop.set()
        thread.join(timeout=60)
    assert not thread.is_alive(), "the relay did not stop"
    assert prepared_left(s.dsn) == []
    check_delivery(s.dsn, topology, before + after, max_duplicates=0)


def relay_of(gid: str) -> str:
    parsed = parse(gid)
    assert parsed is not None, gid
    return parsed.relay_id
