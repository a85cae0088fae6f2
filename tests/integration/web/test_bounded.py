"""Nothing the console does can hang it: an action that meets rows held by an
in-doubt batch says so at once, and no request waits on a lock long enough to
starve the others (real PostgreSQL; no browser)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from outbox import gid as gids
from outbox.config import Settings
from outbox.web.app import WebConfig
from outbox.web.console import ConsoleConfig
from outbox.web.security import Credentials
from tests.fixtures.faults import prepared_left
from tests.fixtures.servers import Topology
from tests.fixtures.web import Console, csrf_headers, http, start_console


@pytest.fixture
def console(settings: Settings) -> Iterator[Console]:
    config = WebConfig(ConsoleConfig((settings,)), settings.amqp_url, Credentials())
    running = start_console(config)
    yield running
    running.stop()


@dataclasses.dataclass(frozen=True)
class HeldDeadLetter:
    row_id: int
    gid: str


@pytest.fixture
def held_dead_letter(settings: Settings) -> Iterator[HeldDeadLetter]:
    """A dead letter whose row id a prepared batch of a dead relay deleted from the
    outbox (a relay killed before COMMIT PREPARED): retrying it inserts that id
    again, which waits on the batch (Lock/transactionid) until it is resolved."""
    gid = str(gids.Gid(settings.table, gids.new_relay_id(), 1))
    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        row = conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload) VALUES ('ex', 'rk', 'p') "
            "RETURNING id"
        ).fetchone()
        assert row is not None
        row_id = int(row[0])
        conn.execute(
            "INSERT INTO outbox_dead_letters (id, message_id, exchange, routing_key, payload, "
            "created_at, reason) VALUES (%s, %s, 'ex', 'rk', 'p', now(), 'exchange missing')",
            [row_id, uuid.uuid4()],
        )
        conn.execute("BEGIN")
        conn.execute("DELETE FROM outbox WHERE id = %s", [row_id])
        conn.execute(psycopg.sql.SQL("PREPARE TRANSACTION {}").format(psycopg.sql.Literal(gid)))
    yield HeldDeadLetter(row_id, gid)
    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        if gid in prepared_left(settings.dsn):
            conn.execute(psycopg.sql.SQL("ROLLBACK PREPARED {}").format(psycopg.sql.Literal(gid)))


def test_web__a_retry_of_a_dead_letter_held_by_an_in_doubt_batch_says_so_at_once(
    console: Console, held_dead_letter: HeldDeadLetter
) -> None:
    started = time.monotonic()
    status, page = http(
        f"{console.url}/dead-letters/retry",
        data={"id": str(held_dead_letter.row_id), "expected": "1"},
        headers=csrf_headers(console),
        timeout=10,
    )
    took = time.monotonic() - started
    assert status == 409, page[:500]
    assert f"held by in-doubt batch {held_dead_letter.gid}: resolve it first" in page
    assert 'action="/in-doubt/resolve"' in page  # the button that releases it
    assert took < 5, f"the refusal took {took:.1f} s"


def test_web__forty_actions_on_held_rows_leave_the_console_answering(
    console: Console, held_dead_letter: HeldDeadLetter
) -> None:
    headers = csrf_headers(console)
    form = {"id": str(held_dead_letter.row_id), "expected": "1"}
    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        posts = [
            pool.submit(
                http, f"{console.url}/dead-letters/retry", data=form, headers=headers, timeout=60
            )
            for _ in range(40)
        ]
        time.sleep(1)  # the 40 are in (each either waiting on the batch or answered)
        for path in ("/", "/static/console.css"):
            status, _ = http(console.url + path, timeout=10)
            assert status == 200, path
        statuses = [p.result()[0] for p in posts]
    assert statuses == [409] * 40


def test_web__a_retry_waiting_on_another_sessions_lock_gives_up_after_the_lock_timeout(
    settings: Settings, console: Console
) -> None:
    """Not an in-doubt batch (nothing to name): the action's lock_timeout ends the wait."""
    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        row = conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload) VALUES ('ex', 'rk', 'p') "
            "RETURNING id"
        ).fetchone()
        assert row is not None
        conn.execute(
            "INSERT INTO outbox_dead_letters (id, message_id, exchange, routing_key, payload, "
            "created_at, reason) VALUES (%s, %s, 'ex', 'rk', 'p', now(), 'r')",
            [row[0], uuid.uuid4()],
        )
    with psycopg.connect(settings.dsn) as holder:
        holder.execute("DELETE FROM outbox WHERE id = %s", [row[0]])  # open transaction
        started = time.monotonic()
        status, page = http(
            f"{console.url}/dead-letters/retry",
            data={"id": str(row[0]), "expected": "1"},
            headers=csrf_headers(console),
            timeout=20,
        )
        took = time.monotonic() - started
        holder.rollback()
    assert status == 409 and "locked by another transaction" in page, page[:500]
    assert took < 10


def ledger_records(topology: Topology) -> int:
    """How many records the ledger stream holds (read from its start until idle)."""
    channel = topology.channel()
    channel.basic_qos(prefetch_count=100)
    count = 0
    for method, _, _ in channel.consume(
        topology.ledger, arguments={"x-stream-offset": "first"}, inactivity_timeout=0.5
    ):
        if method is None:
            break
        count += 1
        channel.basic_ack(method.delivery_tag)
    channel.connection.close()
    return count


def test_web__the_in_doubt_page_writes_nothing_to_the_ledger(
    settings: Settings, topology: Topology, console: Console, held_dead_letter: HeldDeadLetter
) -> None:
    """A GET must not write: any web page could send one (<img src=…/in-doubt>).  The
    dry run, which appends a probe record to find the ledger's end, is a POST."""
    channel = topology.channel()  # as a relay declares it
    channel.queue_declare(topology.ledger, durable=True, arguments={"x-queue-type": "stream"})
    channel.connection.close()
    status, page = http(f"{console.url}/in-doubt")
    assert status == 200 and held_dead_letter.gid in page
    assert ledger_records(topology) == 0  # no probe record was appended
    status, page = http(f"{console.url}/in-doubt/dry-run", data={}, headers={})
    assert status == 403  # a POST, with the CSRF token
    status, page = http(f"{console.url}/in-doubt/dry-run", data={}, headers=csrf_headers(console))
    assert status == 200 and "rollback" in page and "planned" in page
    assert held_dead_letter.gid in prepared_left(settings.dsn)
