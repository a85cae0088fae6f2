"""Rows that appear behind the relays' claim front (``outbox.db.front``) by other
ways than a late commit: a reload from a backup of the outbox (ids and txids
copied), after a DELETE or a TRUNCATE, while the application keeps writing rows of
the same ordering keys; and a row written with the outbox's triggers off (its txid
kept, as ``pg_restore --disable-triggers`` does), while the relays restart every
few seconds, so that no work session lives as long as the safety net's interval.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import threading
import time
from typing import Any

import psycopg
import pytest

from outbox.config import Settings
from tests.fixtures.faults import RelayProcess, check_delivery, rows_left, stamping, wait_for
from tests.fixtures.servers import Topology, run_cli, settings_env

KEYS = 10
RELOADED = 200


def _write(conn: psycopg.Connection[Any], exchange: str, n: int, tag: str) -> str:
    [(message_id,)] = conn.execute(
        "INSERT INTO outbox (exchange, routing_key, payload, ordering_key) "
        "VALUES (%s, 'k', convert_to(%s, 'UTF8'), %s) RETURNING message_id",
        [exchange, f"{tag}{n}", f"K{n % KEYS}"],
    ).fetchall()
    return str(message_id)


@pytest.mark.parametrize("emptied_by", ["delete", "truncate"])
def test_front__reloaded_keyed_rows_keep_their_order_before_later_rows_of_their_keys(
    settings: Settings, topology: Topology, emptied_by: str
) -> None:
    """A backup of 200 keyed rows (keys K0-K9, ids 1-200, their txids copied) is
    loaded back with ``INSERT … OVERRIDING SYSTEM VALUE SELECT *`` into an outbox
    emptied by DELETE or TRUNCATE, while a relay runs and the application goes on
    writing rows of the same keys.  Every row the application writes after the
    reload committed must arrive after every reloaded row of its key."""
    busy = dataclasses.replace(settings, batch_size=20)
    exchange = topology.exchange
    with psycopg.connect(busy.dsn, autocommit=True) as conn:
        committed = [_write(conn, exchange, n, "first") for n in range(RELOADED)]
        conn.execute("CREATE TABLE outbox_bak AS SELECT * FROM outbox")
        # The backup's copies are new messages (their own message ids).
        conn.execute(
            "UPDATE outbox_bak SET message_id = gen_random_uuid(), "
            "payload = convert_to('bak' || id::text, 'UTF8')"
        )
    pause, stop = threading.Event(), threading.Event()
    after_reload = threading.Event()
    paused = threading.Event()
    later: list[str] = []

    def writer() -> None:
        with psycopg.connect(busy.dsn, autocommit=True) as conn:
            for n in itertools.count():
                if stop.is_set():
                    return
                if pause.is_set():
                    paused.set()
                    time.sleep(0.01)
                    continue
                reloaded = after_reload.is_set()
                message_id = _write(conn, exchange, n, "after" if reloaded else "app")
                committed.append(message_id)
                if reloaded:
                    later.append(message_id)
                time.sleep(0.005)

    relay = RelayProcess(busy)
    thread = threading.Thread(target=writer)
    thread.start()
    try:
        wait_for(lambda: len(committed) > RELOADED + 300, 30, "the application's rows")
        pause.set()
        wait_for(paused.is_set, 10, "the writer to pause")
        wait_for(lambda: rows_left(busy.dsn) == 0, 30, "the relay to drain the outbox")
        with psycopg.connect(busy.dsn) as conn:
            if emptied_by == "truncate":
                conn.execute("SET lock_timeout = '10s'")
                conn.execute("TRUNCATE outbox")
            else:
                conn.execute("DELETE FROM outbox")
            reloaded = [
                str(r[0])
                for r in conn.execute(
                    "INSERT INTO outbox OVERRIDING SYSTEM VALUE SELECT * FROM outbox_bak "
                    "ORDER BY id RETURNING message_id"
                ).fetchall()
            ]
        after_reload.set()
        pause.clear()
        wait_for(lambda: len(later) >= 300, 30, "rows written after the reload")
        stop.set()
        thread.join()
        wait_for(lambda: rows_left(busy.dsn) == 0, 60, "the relay to drain the outbox")
    finally:
        stop.set()
        pause.clear()
        thread.join()
        relay.close()
    messages = topology.messages(idle=1.0)
    position: dict[str, int] = {}
    key_of: dict[str, str] = {}
    for at, (_, props, _) in enumerate(messages):
        position.setdefault(str(props.message_id), at)
        key_of[str(props.message_id)] = props.headers["x-ordering-key"]
    by_key: dict[str, list[str]] = collections.defaultdict(list)
    for message_id in reloaded:
        by_key[key_of[message_id]].append(message_id)
    overtaken = {(r, a) for a in later for r in by_key[key_of[a]] if position[a] < position[r]}
    print(f"{emptied_by}: {len(overtaken)} (reloaded, later) pairs out of order")
    assert not overtaken, f"{len({r for r, _ in overtaken})} reloaded rows overtaken"
    taken = collections.Counter(str(p.message_id) for _, p, _ in messages)
    check_delivery(busy.dsn, topology, [*committed, *reloaded], max_duplicates=0, taken=taken)


RESCAN = 6.0  # the safety net's interval in the test (600 s by default)
LIFETIME = 4.0  # each relay is restarted after this, shorter than the interval


def test_front__a_row_with_a_foreign_txid_is_published_within_the_bound_while_relays_restart(
    settings: Settings, topology: Topology
) -> None:
    """Two relays, each restarted cleanly every 4 s (a deploy, a crash loop, a
    reconnect), the safety net's interval 6 s: no work session lives as long as the
    interval.  A row written with the triggers off, its txid NULL and its id below
    the saved front, must still be published within the bound (1.5 intervals, plus
    a restart) and ``outbox status`` must say when the last full pass ran."""
    netted = dataclasses.replace(settings, rescan_interval=RESCAN)
    exchange = topology.exchange
    with psycopg.connect(netted.dsn, autocommit=True) as conn:
        first = [_write(conn, exchange, n, "first") for n in range(50)]
    relays = [RelayProcess(netted), RelayProcess(netted)]
    try:
        wait_for(lambda: rows_left(netted.dsn) == 0, 30, "the first rows")
        with psycopg.connect(netted.dsn, autocommit=True) as conn:
            first += [_write(conn, exchange, n, "second") for n in range(50)]
        wait_for(lambda: rows_left(netted.dsn) == 0, 30, "the second rows")
        turn = 0

        def restart_one() -> None:
            nonlocal turn
            time.sleep(LIFETIME / 2)
            relays[turn].process.terminate()  # a clean stop: the front is saved
            relays[turn].wait()
            relays[turn] = RelayProcess(netted)
            turn = 1 - turn

        # The relays keep restarting for an interval before the row is written:
        # whatever pass ran at their first start is behind them.
        started = time.monotonic()
        while time.monotonic() < started + RESCAN:
            restart_one()
        stamping(netted.dsn, on=False)
        with psycopg.connect(netted.dsn, autocommit=True) as conn:
            [(foreign,)] = conn.execute(
                "INSERT INTO outbox (id, exchange, routing_key, payload, txid) "
                "OVERRIDING SYSTEM VALUE VALUES (1, %s, 'k', 'foreign', NULL) "
                "RETURNING message_id",
                [exchange],
            ).fetchall()
            [(low_water,)] = conn.execute("SELECT low_water FROM outbox_claim_front").fetchall()
        stamping(netted.dsn, on=True)
        assert low_water > 1, low_water
        written = time.monotonic()
        bound = 1.5 * RESCAN + LIFETIME
        while rows_left(netted.dsn) and time.monotonic() < written + 3 * bound:
            restart_one()
        waited = time.monotonic() - written
        print(f"the row with a foreign txid was published after {waited:.1f}s (bound {bound}s)")
        assert rows_left(netted.dsn) == 0, f"still unpublished after {waited:.1f}s"
        assert waited <= bound, waited
        result = run_cli("status", "--json", env=settings_env(netted))
        report = json.loads(result.stdout)
        assert report["backlog_counted"] == "claim front", report
        assert report["last_full_pass_age_seconds"] <= bound, report
    finally:
        for relay in relays:
            relay.close()
    check_delivery(netted.dsn, topology, [*first, str(foreign)], max_duplicates=0)
