"""Several relays under random kill -9 while rows are written, then everything drained."""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import pytest

from outbox.config import Settings
from tests.fixtures.faults import (
    chaos_run,
    check_delivery,
    in_flight,
    insert_rows,
)
from tests.fixtures.servers import Topology

BATCH = 20
RELAYS = 3
CHAOS_SECONDS = 15


@pytest.mark.parametrize(
    "pipeline",
    [
        pytest.param(False, id="serial"),
        # Also against a multi-database relay (``-m fleet_faults``).
        pytest.param(True, id="pipelined", marks=pytest.mark.fleet_faults),
    ],
)
def test_chaos__relays_killed_at_random_lose_nothing(
    settings: Settings, topology: Topology, chaos_seed: int
) -> None:
    chaos = dataclasses.replace(settings, batch_size=BATCH)
    rng = random.Random(chaos_seed + 1)  # the writer's; chaos_run's kills use chaos_seed
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

    kills = chaos_run(
        chaos,
        [threading.Thread(target=writer)],
        stop_writing,
        relays=RELAYS,
        seconds=CHAOS_SECONDS,
        seed=chaos_seed,
    )
    # Each kill can leave at most one batch (pipelined: two) published but rolled back.
    bound = kills * in_flight(chaos) * BATCH
    report = check_delivery(chaos.dsn, topology, committed, max_duplicates=bound)
    assert len(report.counts) == len(committed)
