"""Exactly-once effects end to end, under kill -9 of relays and consumers alike.

Applications commit rows while two relays and three ``outbox consume`` processes
run against one queue; every second or so one of them is killed with SIGKILL and
restarted, and half the consumer starts are armed to kill themselves right after
a commit, before the ack.  The handler writes one row per message into a table
WITHOUT a unique constraint.  Afterwards: exactly one effect row per committed
outbox row, none missing, none extra, nothing prepared or parked.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import threading
import time
from pathlib import Path

import psycopg

from outbox.config import Settings
from tests.fixtures.faults import (
    RelayProcess,
    drain,
    insert_rows,
    prepared_left,
    relay_sessions,
    rows_left,
    wait_for,
)
from tests.fixtures.servers import Topology
from tests.integration.inbox.test_inbox import (
    ConsumeProcess,
    ready_messages,
    scalar,
)

BATCH = 20
RELAYS = 2
CONSUMERS = 3
CHAOS_SECONDS = 20


def test_chaos__relays_and_consumers_killed_at_random_give_one_effect_per_row(
    settings: Settings, topology: Topology, consumer_dsn: str, tmp_path: Path, chaos_seed: int
) -> None:
    chaos = dataclasses.replace(settings, batch_size=BATCH)
    rng = random.Random(chaos_seed)  # kills and crash points
    writing = random.Random(chaos_seed + 1)  # the writer thread's own
    committed: list[str] = []
    stop_writing = threading.Event()

    def writer() -> None:
        n = 0
        while not stop_writing.is_set():
            n += 1
            committed.extend(
                insert_rows(chaos.dsn, topology.exchange, writing.randint(1, 20), tag=f"w{n}-")
            )
            time.sleep(0.05)

    logs: list[str] = []  # every consumer's log, read when it ends
    started: list[ConsumeProcess] = []  # every consumer, in order

    def consumer() -> ConsumeProcess:
        # The first consumer is armed to crash early and spared by the kills below, so
        # that a crash after a commit happens in every run (asserted at the end); the
        # others are armed as the seed says.
        first = not started
        armed = first or rng.random() < 0.5
        after = 2 if first else rng.randint(5, 60)
        crash = {"OUTBOX_CRASH_AT": f"consume_after_commit:{after}"} if armed else {}
        process = ConsumeProcess(tmp_path, "record", consumer_dsn, topology, extra_env=crash)
        started.append(process)
        return process

    def end(process: ConsumeProcess) -> int:
        if process.process.poll() is None:
            process.kill()
        code = process.process.returncode
        process.close()
        logs.append(process.output())
        return code

    relays = [RelayProcess(chaos) for _ in range(RELAYS)]
    consumers = [consumer() for _ in range(CONSUMERS)]
    thread = threading.Thread(target=writer)
    thread.start()
    kills = collections.Counter[str]()
    try:
        deadline = time.monotonic() + CHAOS_SECONDS
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(0.3, 1.0))
            for i, process in enumerate(consumers):  # armed ones that fired
                if process.process.poll() is not None:
                    end(process)
                    kills["consumer crashed after commit"] += 1
                    consumers[i] = consumer()
            victim = rng.randrange(RELAYS + CONSUMERS)
            if victim < RELAYS:
                relays[victim].kill()
                relays[victim].close()
                relays[victim] = RelayProcess(chaos)
                kills["relay"] += 1
            elif consumers[victim - RELAYS] is started[0]:
                continue  # spared until it crashes by itself
            else:
                end(consumers[victim - RELAYS])
                consumers[victim - RELAYS] = consumer()
                kills["consumer"] += 1
    finally:
        stop_writing.set()
        thread.join()
        for relay in relays:
            relay.kill()
            relay.close()
    try:
        wait_for(lambda: relay_sessions(chaos.dsn) == 0, 10, "killed relays' sessions to end")
        drain(chaos)  # `outbox relay --drain`: every committed row is on the queue
        for i, process in enumerate(consumers):  # no more crash points from here on
            end(process)
            consumers[i] = ConsumeProcess(tmp_path, "record", consumer_dsn, topology)
        for process in consumers:
            wait_for(lambda p=process: "consumer.started" in p.output(), 30, "a consumer")

        def effect_ids() -> int:
            return int(scalar(consumer_dsn, "SELECT count(DISTINCT message_id) FROM effects"))

        wait_for(lambda: effect_ids() == len(committed), 60, "an effect for every row")
        wait_for(lambda: ready_messages(topology) == 0, 30, "the queue to empty")
        for process in consumers:
            process.process.terminate()
            assert process.wait() == 0, process.output()[-3000:]
    finally:
        for process in consumers:
            end(process)

    assert prepared_left(chaos.dsn) == [] and rows_left(chaos.dsn) == 0
    with_counts = collections.Counter(
        r[0] for r in _all(consumer_dsn, "SELECT message_id FROM effects")
    )
    doubled = {m: n for m, n in with_counts.items() if n > 1}
    missing = set(committed) - set(with_counts)
    extra = set(with_counts) - set(committed)
    assert not doubled, f"{len(doubled)} messages applied more than once"
    assert not missing, f"{len(missing)} committed rows without an effect"
    assert not extra, f"{len(extra)} effects nobody committed"
    assert len(with_counts) == len(committed) == sum(with_counts.values())
    assert scalar(consumer_dsn, "SELECT count(*) FROM inbox_parked") == 0
    duplicates_skipped = sum(log.count("consumer.duplicate_skipped") for log in logs)
    print(f"{len(committed)} rows committed, kills: {dict(kills)}, {duplicates_skipped} skipped")
    assert kills["relay"] and kills["consumer"], kills
    # Every consumer that killed itself after a commit left one message to skip.
    assert duplicates_skipped >= kills["consumer crashed after commit"] > 0, (
        duplicates_skipped,
        kills,
    )


def _all(dsn: str, query: str) -> list[tuple[str]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(query).fetchall()
