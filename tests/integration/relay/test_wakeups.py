"""Wake-ups: the outbox trigger notifies only while a relay waits (schema 0005).

A NOTIFY makes its transaction hold a database-wide lock from COMMIT until the
commit is flushed, so notifying commits cannot share a WAL flush.  An idle relay
holds the wake-up lock in shared mode and is notified; a busy one lets it go, and
the applications' commits then do not notify.  A commit whose INSERT ran while no
relay waited is found by the relay's polls soon after it takes the lock.
"""

from __future__ import annotations

import dataclasses
import random
import signal
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

import outbox
from outbox import gid as gids
from outbox.config import Settings
from outbox.db.relays import WakeupListener
from outbox.relay.process import Relay
from tests.fixtures.faults import RelayProcess, check_delivery, insert_rows, rows_left, wait_for
from tests.fixtures.servers import Topology


def notified(listener: psycopg.Connection[tuple[object, ...]], timeout: float = 0.3) -> int:
    return len(list(listener.notifies(timeout=timeout)))


def wakeup_lock_holders(dsn: str) -> int:
    """Sessions holding the wake-up lock of this database's outbox."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " AND classid = %s AND objid = 'outbox'::regclass::oid::integer::oid",
            [gids.WAKEUP_LOCK_CLASS],
        ).fetchone()
    return int(row[0]) if row else 0


def wait_until_polls_apart(dsn: str, relays: int, seconds: float, timeout: float) -> None:
    """Wait until each of ``relays`` idle relays has gone ``seconds`` without a poll.

    Idle is holding the wake-up lock (a busy relay lets it go, and does not poll);
    the last poll is the last query of the relay's wake-up session (notifications
    arrive without one).  An idle relay doubles its pause after every poll
    (``Relay._wait_for_work``), so once it has gone ``seconds`` without one its polls
    stay at least that far apart until it has work again: each relay is counted from
    the first time it is seen so (by its session's backend), not all at once."""
    apart: set[int] = set()

    def every_relay_slow() -> bool:
        with psycopg.connect(dsn, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT a.pid FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid"
                " WHERE a.datname = current_database()"
                " AND a.application_name = 'outbox-relay-wakeup' AND a.state = 'idle'"
                " AND clock_timestamp() - a.query_start >= make_interval(secs => %s)"
                " AND l.locktype = 'advisory' AND l.granted AND l.classid = %s"
                " AND l.objid = 'outbox'::regclass::oid::integer::oid",
                [seconds, gids.WAKEUP_LOCK_CLASS],
            ).fetchall()
        apart.update(int(r[0]) for r in rows)
        return len(apart) >= relays

    wait_for(every_relay_slow, timeout, f"{relays} relays' polls {seconds} s apart")


@pytest.fixture
def listener(settings: Settings) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    conn = psycopg.connect(settings.dsn, autocommit=True)
    conn.execute("LISTEN outbox")
    yield conn
    conn.close()


def commit_one(dsn: str, exchange: str) -> None:
    with psycopg.connect(dsn) as conn:
        outbox.enqueue(conn, exchange=exchange, routing_key="k", payload=b"x")


def test_trigger__notifies_only_while_a_relay_waits(
    settings: Settings,
    topology: Topology,
    listener: psycopg.Connection[tuple[object, ...]],
) -> None:
    commit_one(settings.dsn, topology.exchange)
    assert notified(listener) == 0, "nobody waits: the commit must not notify"

    waiting = WakeupListener(settings.dsn, settings.table)
    try:
        assert waiting.want_wakeups()  # the row committed above
        assert waiting.wanting
        commit_one(settings.dsn, topology.exchange)
        assert notified(listener) == 1

        waiting.stop_wanting_wakeups()
        commit_one(settings.dsn, topology.exchange)
        assert notified(listener) == 0
    finally:
        waiting.close()


def test_trigger__notifies_while_any_of_several_relays_waits(
    settings: Settings,
    topology: Topology,
    listener: psycopg.Connection[tuple[object, ...]],
) -> None:
    first = WakeupListener(settings.dsn, settings.table)
    second = WakeupListener(settings.dsn, settings.table)
    try:
        first.want_wakeups()
        second.want_wakeups()
        assert wakeup_lock_holders(settings.dsn) == 2
        first.stop_wanting_wakeups()
        commit_one(settings.dsn, topology.exchange)
        assert notified(listener) == 1, "the second relay still waits"
        second.close()  # a relay that dies lets go with its session
        wait_for(lambda: wakeup_lock_holders(settings.dsn) == 0, 10, "the lock to go")
        commit_one(settings.dsn, topology.exchange)
        assert notified(listener) == 0
    finally:
        first.close()
        second.close()


def test_relay__busy_lets_commits_go_without_notify(
    settings: Settings,
    topology: Topology,
    listener: psycopg.Connection[tuple[object, ...]],
) -> None:
    # The relay is held between two batches of its backlog while the late row is
    # committed: certainly busy then, however fast the machine drains 300 rows.
    held, release = threading.Event(), threading.Event()

    def hold_at_the_fifth(gid: str, stats: object) -> None:
        if relay.stats.messages_published == 5:
            held.set()
            release.wait(30)

    relay = Relay(
        dataclasses.replace(settings, batch_size=1, pipeline=False), on_batch=hold_at_the_fifth
    )
    relay.start()
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        # Idle first (holding the lock), then woken by a backlog: busy, it lets go.
        wait_for(lambda: wakeup_lock_holders(settings.dsn) == 1, 10, "the relay to wait")
        backlog = insert_rows(settings.dsn, topology.exchange, 300)
        assert held.wait(30), "the relay did not get busy"
        assert notified(listener) == 1, "the backlog's commit did not wake the relay"
        assert wakeup_lock_holders(settings.dsn) == 0, "a busy relay holds the wake-up lock"
        late = insert_rows(settings.dsn, topology.exchange, 1)
        assert notified(listener, timeout=0.2) == 0, "a commit notified while the relay was busy"
        release.set()
        wait_for(
            lambda: relay.stats.messages_published == len(backlog) + 1, 60, "the relay to drain"
        )
        # Idle again: it waits, holding the lock, and a commit wakes it.
        wait_for(lambda: wakeup_lock_holders(settings.dsn) == 1, 10, "the relay to wait")
    finally:
        release.set()
        relay.stop.set()
        thread.join(timeout=30)
    check_delivery(settings.dsn, topology, backlog + late, max_duplicates=0)


def test_relay__finds_a_commit_whose_insert_ran_before_it_waited(
    settings: Settings, topology: Topology
) -> None:
    # The INSERT runs while no relay waits: its trigger does not notify, and its
    # commit comes after the relay took the lock and looked.  The fallback poll is
    # 30 s: only the relay's early polls can find the row in time.
    relay = Relay(
        dataclasses.replace(
            settings, poll_interval=30.0, heartbeat_interval=10.0, relay_timeout=60.0
        )
    )
    app = psycopg.connect(settings.dsn)
    try:
        outbox.enqueue(app, exchange=topology.exchange, routing_key="k", payload=b"late")
        relay.start()
        thread = threading.Thread(target=relay.run)
        thread.start()
        wait_for(lambda: wakeup_lock_holders(settings.dsn) == 1, 10, "the relay to wait")
        # Its early polls already a while apart: the commit comes after several.
        wait_until_polls_apart(settings.dsn, 1, 0.25, 10)
        app.commit()
        committed = time.monotonic()
        wait_for(lambda: relay.stats.messages_published == 1, 15, "the late commit")
        # Found by the poll about twice as long after the lock was taken (≈ 1 s).
        assert time.monotonic() - committed < 10
    finally:
        app.close()
        relay.stop.set()
        thread.join(timeout=30)


def test_relays__several_going_idle_and_busy_under_bursts_miss_no_wake_up(
    settings: Settings, topology: Topology
) -> None:
    """Three relays, writers committing in bursts with pauses long and short, each
    transaction holding its INSERT a while before COMMIT: relays go busy (the lock let
    go, commits do not notify) and idle (the lock taken, early polls) in every order.
    Half-way, no commit until every relay has gone 4 s without a poll (its polls then
    stay at least 4 s apart, about 8 s after 12 s idle), so a
    commit that neither notified nor was found by the early polls sits for seconds
    (the fallback poll is 30 s; with the trigger's NOTIFY removed, rows waited 1.9 to
    3.7 s in 4 runs of 4, and 0.05 s with it): no row may stay 1 s, nothing is lost,
    nothing is sent twice."""
    relaxed = dataclasses.replace(settings, poll_interval=30.0)
    relays = [RelayProcess(relaxed) for _ in range(3)]
    committed: list[str] = []
    lock = threading.Lock()
    oldest = [0.0]
    done = threading.Event()

    def write(seed: int) -> None:
        rng = random.Random(seed)
        with psycopg.connect(settings.dsn) as conn:
            for _ in range(6):
                for _ in range(rng.randint(1, 15)):
                    ids = [
                        outbox.enqueue(
                            conn, exchange=topology.exchange, routing_key="k", payload=b"b"
                        )
                        for _ in range(rng.randint(1, 3))
                    ]
                    time.sleep(
                        rng.choice([0.0, 0.0, 0.005, 0.03])
                    )  # INSERT done, not yet committed
                    conn.commit()
                    with lock:
                        committed.extend(str(i) for i in ids)
                time.sleep(rng.choice([0.0, 0.01, 0.1, 0.4, 0.8]))

    def watch() -> None:
        with psycopg.connect(settings.dsn, autocommit=True) as conn:
            while not done.is_set():
                row = conn.execute(
                    "SELECT extract(epoch FROM clock_timestamp() - min(created_at)) FROM outbox"
                ).fetchone()
                if row and row[0] is not None:
                    oldest[0] = max(oldest[0], float(row[0]))
                time.sleep(0.05)

    try:
        wait_for(lambda: wakeup_lock_holders(settings.dsn) == 3, 30, "three relays to wait")
        watcher = threading.Thread(target=watch)
        watcher.start()
        for round_ in range(2):
            if round_:
                # every relay idle, its polls seconds apart
                wait_until_polls_apart(settings.dsn, len(relays), 4.0, 60)
            writers = [
                threading.Thread(target=write, args=(4 * round_ + seed,)) for seed in range(4)
            ]
            for writer in writers:
                writer.start()
            for writer in writers:
                writer.join()
        wait_for(lambda: rows_left(settings.dsn) == 0, 20, "the relays to drain")
        done.set()
        watcher.join()
        for relay in relays:
            relay.process.send_signal(signal.SIGTERM)
        for relay in relays:
            assert relay.wait(30) == 0, relay.output()
    finally:
        done.set()
        for relay in relays:
            relay.close()
    # Oldest row's age counts from its transaction's start (created_at = now()).
    assert oldest[0] < 1, f"a row waited {oldest[0]:.1f} s: a wake-up was missed"
    report = check_delivery(settings.dsn, topology, committed, max_duplicates=0)
    assert report.duplicates == 0


def test_relay__a_trickle_keeps_the_wake_up_lock_and_is_woken_by_each_commit(
    settings: Settings,
    topology: Topology,
    listener: psycopg.Connection[tuple[object, ...]],
) -> None:
    """One row at a time, 0.1 s apart: each is claimed by one step and committed by the
    next, which claims nothing.  That is no backlog: the relay keeps the wake-up lock
    and each commit wakes it by NOTIFY (before, every row let the lock go and took it
    back, with a dozen polls after: 8.5 ms of CPU per row at 20 rows/s)."""
    relay = Relay(settings)
    relay.start()
    assert relay.wakeups is not None
    let_go: list[float] = []
    stop_wanting = relay.wakeups.stop_wanting_wakeups

    def counted() -> None:
        let_go.append(time.monotonic())
        stop_wanting()

    relay.wakeups.stop_wanting_wakeups = counted  # type: ignore[method-assign]
    thread = threading.Thread(target=relay.run)
    thread.start()
    committed: list[str] = []
    try:
        wait_for(lambda: wakeup_lock_holders(settings.dsn) == 1, 10, "the relay to wait")
        for _ in range(10):
            committed += insert_rows(settings.dsn, topology.exchange, 1)
            time.sleep(0.1)
        wait_for(lambda: relay.stats.messages_published == 10, 30, "the trickle to go out")
        assert notified(listener) == 10, "a commit of the trickle did not notify"
        assert let_go == [], f"the relay let the wake-up lock go {len(let_go)} times"
    finally:
        relay.stop.set()
        thread.join(timeout=30)
    check_delivery(settings.dsn, topology, committed, max_duplicates=0)
