"""``outbox demo --consume``: exactly-once effects end to end, with a crash.

Commits rows, relays them, delivers copies of some of them again (what a relay
crash does), then runs ``outbox consume`` with a handler that writes one row per
message into a table without a unique constraint, kills it with SIGKILL halfway,
starts it again, and checks that every committed row has exactly one effect row.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable

import pika

from outbox.config import Settings
from outbox.db import migrate, session
from outbox.demo import reader as consumer
from outbox.demo.relay import scratch_database, write_rows
from outbox.relay.process import Relay
from outbox.tables import table_names

HANDLER = '''import time


def apply(conn, message):
    """One effect row per message, in the transaction that records its id."""
    time.sleep(0.002)  # some work, so that the demo can kill it halfway
    conn.execute(
        "INSERT INTO {effects} (message_id, routing_key, body) VALUES (%s, %s, %s)",
        [message.message_id, message.routing_key, message.body],
    )
'''

COPIES = 100


def run_inbox_demo(
    *, dsn: str | None, amqp_url: str, rows: int, echo: Callable[[str], None]
) -> bool:
    suffix = uuid.uuid4().hex[:8]
    exchange, queue = f"outbox.demo.{suffix}", f"outbox.demo.{suffix}"
    effects, inbox = f"demo_effects_{suffix}", f"demo_inbox_{suffix}"
    with scratch_database(dsn, echo) as database, tempfile.TemporaryDirectory() as folder:
        settings = Settings(
            dsn=database,
            amqp_url=amqp_url,
            table=f"outbox_demo_{suffix}",
            ledger_queue=f"outbox.demo.ledger.{suffix}",
        )
        conn = session.connect(database, application_name="outbox-demo")
        try:
            migrate.migrate(conn, settings.table)
            conn.execute(f"CREATE TABLE {effects} (message_id text, routing_key text, body bytea)")
            echo(f"created {settings.table!r} and {effects!r} (no unique constraint)")
            consumer.declare(amqp_url, exchange=exchange, queue=queue)
            sent = write_rows(conn, settings.table, exchange, rows, echo)
            relay = Relay(settings)
            relay.start()
            stats = relay.run(drain=True)
            echo(f"relay drained the table: {stats.messages_published} messages on {queue!r}")
            _deliver_copies(amqp_url, queue, sent)
            echo(f"delivered {COPIES} of them a second time, as a relay crash would")
            with open(os.path.join(folder, "demo_handler.py"), "w") as handler:
                handler.write(HANDLER.replace("{effects}", effects))
            env = dict(
                os.environ,
                OUTBOX_DSN=database,
                OUTBOX_AMQP_URL=amqp_url,
                OUTBOX_QUEUE=queue,
                OUTBOX_INBOX_TABLE=inbox,
                OUTBOX_LOG_LEVEL="warning",
            )
            echo(f"$ outbox consume demo_handler:apply --queue {queue} --inbox-table {inbox}")
            first = _consume(folder, env)
            _wait(lambda: _count(conn, effects) >= len(sent) // 3, first)
            first.kill()
            first.wait()
            echo(
                f"  killed it with SIGKILL after {_count(conn, effects)} effects; starting it again"
            )
            second = _consume(folder, env)
            try:
                _wait(
                    lambda: _count(conn, effects) >= len(sent) and _depth(amqp_url, queue) == 0,
                    second,
                )
                time.sleep(0.5)  # any stray copy would show up now
            finally:
                second.send_signal(signal.SIGTERM)
                _, stderr = second.communicate(timeout=30)
            echo("  " + (stderr.strip().splitlines() or ["(no summary)"])[-1])
            return _report(conn, effects, sent, echo)
        finally:
            with contextlib.suppress(Exception):
                consumer.delete(amqp_url, exchange=exchange, queue=queue)
                consumer.delete(amqp_url, queue=settings.ledger_queue)
            with contextlib.suppress(Exception):
                for name in table_names(settings.table):
                    conn.execute(f'DROP TABLE IF EXISTS "{name}" CASCADE')
                for table in (effects, inbox, f"{inbox}_attempts", f"{inbox}_parked"):
                    conn.execute(f'DROP TABLE IF EXISTS "{table}"')
                conn.execute(f'DROP FUNCTION IF EXISTS "{inbox}_guard"()')
            conn.close()


def _deliver_copies(amqp_url: str, queue: str, sent: set[str]) -> None:
    """Copies of the first messages with their message ids, straight to the queue."""
    channel_conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    channel = channel_conn.channel()
    channel.confirm_delivery()
    for message_id in sorted(sent)[:COPIES]:
        channel.basic_publish(
            "", queue, b"copy", pika.BasicProperties(message_id=message_id, delivery_mode=2)
        )
    channel_conn.close()


def _consume(folder: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "outbox", "consume", "demo_handler:apply"],
        cwd=folder,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait(condition: Callable[[], bool], process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while not condition():
        if process.poll() is not None:
            raise RuntimeError(f"outbox consume exited: {process.communicate()[1][-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError("outbox consume did not finish within 120 s")
        time.sleep(0.01)


def _count(conn: session.Conn, effects: str) -> int:
    row = conn.execute(f"SELECT count(*) AS n FROM {effects}").fetchone()
    return int(row["n"]) if row else 0


def _depth(amqp_url: str, queue: str) -> int:
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        return int(connection.channel().queue_declare(queue, passive=True).method.message_count)
    finally:
        connection.close()


def _report(conn: session.Conn, effects: str, sent: set[str], echo: Callable[[str], None]) -> bool:
    rows = conn.execute(f"SELECT message_id FROM {effects}").fetchall()
    counts = Counter(r["message_id"] for r in rows)
    missing = sent - counts.keys()
    doubled = sum(1 for n in counts.values() if n > 1)
    unexpected = counts.keys() - sent
    echo(
        f"effects: {len(rows)} rows for {len(sent)} committed rows: {len(missing)} missing, "
        f"{doubled} applied twice, {len(unexpected)} unexpected"
    )
    ok = not missing and not doubled and not unexpected and len(rows) == len(sent)
    echo("OK: every committed row had exactly one effect" if ok else "FAILED")
    return ok
