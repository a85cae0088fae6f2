"""A row whose transaction took its id early and committed late, after the relay
claimed the rows behind it and moved its claims past it (``outbox.db.front``).

The relay's claims start at a low-water mark and find such a row by the
transaction that inserted it: the first claim after its commit takes it, and an
idle relay's polls find it as they find any commit that did not notify (the
wake-up lock was not held when its INSERT ran): within about twice the time since
the relay went idle, at most ``--poll-interval``
(docs/explanation/how-it-works.md#claims-and-dead-rows).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import psycopg

import outbox
from outbox.config import Settings
from outbox.relay.process import Relay
from tests.fixtures.faults import check_delivery, insert_rows, wait_for
from tests.fixtures.servers import Topology


def test_relay__publishes_a_row_committed_late_behind_its_claims(
    settings: Settings, topology: Topology
) -> None:
    relay = Relay(
        dataclasses.replace(
            settings, poll_interval=30.0, heartbeat_interval=10.0, relay_timeout=60.0
        )
    )
    app = psycopg.connect(settings.dsn)
    thread = threading.Thread(target=relay.run)
    try:
        late = str(
            outbox.enqueue(app, exchange=topology.exchange, routing_key="k", payload=b"late")
        )
        relay.start()
        thread.start()
        # Rows with later ids flow while the first transaction stays open.
        later = insert_rows(settings.dsn, topology.exchange, 50)
        wait_for(lambda: relay.stats.messages_published == 50, 30, "the later rows")
        more = insert_rows(settings.dsn, topology.exchange, 10)
        wait_for(lambda: relay.stats.messages_published == 60, 30, "more rows")
        assert relay.store is not None
        front = relay.store.front.low_water
        [(late_id,)] = app.execute("SELECT id FROM outbox").fetchall()
        assert front is not None and front > late_id, (front, late_id)
        app.commit()
        committed = time.monotonic()
        wait_for(lambda: relay.stats.messages_published == 61, 15, "the late row")
        assert time.monotonic() - committed < 10  # the fallback poll is 30 s
    finally:
        app.close()
        relay.stop.set()
        if thread.is_alive():
            thread.join(timeout=30)
    check_delivery(settings.dsn, topology, [late, *later, *more], max_duplicates=0)


def test_relay__a_row_committed_late_while_no_relay_ran_is_published_by_the_next(
    settings: Settings, topology: Topology
) -> None:
    """A relay that stops cleanly saves its claim front (schema 0007), and the next
    relay starts from it: a row that took its id before that front and committed
    while no relay ran is published, and so are the rows after it."""
    app = psycopg.connect(settings.dsn)
    try:
        late = str(
            outbox.enqueue(app, exchange=topology.exchange, routing_key="k", payload=b"late")
        )
        early = insert_rows(settings.dsn, topology.exchange, 5)
        first = Relay(settings)
        first.start()
        first.run(drain=True)  # and stops, cleanly
        with psycopg.connect(settings.dsn) as conn:
            saved = conn.execute("SELECT low_water FROM outbox_claim_front").fetchone()
        [[late_id]] = app.execute("SELECT id FROM outbox").fetchall()
        assert saved is not None and saved[0] > late_id, (saved, late_id)
        app.commit()
    finally:
        app.close()
    later = insert_rows(settings.dsn, topology.exchange, 3)
    second = Relay(settings)
    try:
        second.start()
        second.run(drain=True)
        assert second.stats.messages_published == 4
    finally:
        second.close()
    check_delivery(settings.dsn, topology, [*early, late, *later], max_duplicates=0)
