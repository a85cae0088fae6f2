"""Several relays under random kill -9 while rows are written, then everything drained."""

from __future__ import annotations

import dataclasses
import random
import threading
import time

from outbox.config import Settings
from tests.fixtures.faults import (
    RelayProcess,
    both_modes,
    check_delivery,
    in_flight,
    insert_rows,
    relay_sessions,
    wait_for,
)
from tests.fixtures.servers import Topology

BATCH = 20
RELAYS = 3
CHAOS_SECONDS = 15


@both_modes
def test_chaos__relays_killed_at_random_lose_nothing(
    settings: Settings, topology: Topology
) -> None:
    chaos = dataclasses.replace(settings, batch_size=BATCH)
    rng = random.Random()
    committed: list[str] = []
    stop_writing = threading.Event()

    def writer() -> None:
        n = 0
        while not stop_writing.is_set():
            n += 1
            committed.extend(
                insert_rows(chaos.dsn, topology.exchange, rng.randint(1, 30), tag=f"w{n}-")
            )
            time.sleep(0.02)

    relays = [RelayProcess(chaos) for _ in range(RELAYS)]
    thread = threading.Thread(target=writer)
    thread.start()
    kills = 0
    try:
        deadline = time.monotonic() + CHAOS_SECONDS
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(0.3, 1.5))
            victim = rng.randrange(RELAYS)
            relays[victim].kill()
            relays[victim].close()
            kills += 1
            relays[victim] = RelayProcess(chaos)
    finally:
        stop_writing.set()
        thread.join()
        for relay in relays:
            relay.kill()
            relay.close()
    kills += RELAYS
    wait_for(lambda: relay_sessions(chaos.dsn) == 0, 10, "killed relays' sessions to end")
    final = RelayProcess(chaos, drain=True)
    try:
        assert final.wait(timeout=120) == 0, final.output()
    finally:
        final.close()
    # Each kill can leave at most one batch (pipelined: two) published but rolled back.
    bound = kills * in_flight(chaos) * BATCH
    report = check_delivery(chaos.dsn, topology, committed, max_duplicates=bound)
    assert len(report.counts) == len(committed)
