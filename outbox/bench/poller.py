"""The latency run's baseline: the relay's own loop without two-phase commit.

``python -m outbox.bench.poller`` (``OUTBOX_DSN``, ``OUTBOX_TABLE``,
``OUTBOX_AMQP_URL``) moves rows the way a careful hand-rolled poller would, with
the relay's publisher so that the difference is exactly what the guarantee costs::

    BEGIN; DELETE … WHERE id IN (SELECT … FOR UPDATE SKIP LOCKED LIMIT n) RETURNING …
    publish (persistent, mandatory, confirms pipelined)
    COMMIT                           -- ROLLBACK if a message was not confirmed

It is woken by the outbox trigger's NOTIFY as the relay is: it holds the wake-up
lock while it waits and lets it go once busy (``WakeupListener``, schema 5), and
polls soon after taking it, then less often (``WakeupListener.poll_pause``).  It
has no PREPARE, no ledger record and no COMMIT PREPARED, so a crash between the confirms and the
COMMIT publishes the batch again with nothing to say so, and the batch's row locks
end with the session: it is a yardstick for ``outbox bench``, never a way to
deploy.  It prints ``ready`` once connected and listening, and stops on SIGTERM.
"""

from __future__ import annotations

import os
import signal
import sys
import types

from psycopg import sql

from outbox.amqp.confirms import Outcome
from outbox.amqp.frames import Message
from outbox.amqp.publisher import Publisher
from outbox.db import session
from outbox.db.relays import WakeupListener

BATCH_SIZE = 1000
CONFIRM_TIMEOUT = 30.0

_stop = False


def _stopping(_signum: int, _frame: types.FrameType | None) -> None:
    global _stop
    _stop = True


def claim(table: str, limit: int) -> sql.Composed:
    return sql.SQL(
        "DELETE FROM {t} WHERE id IN "
        "(SELECT id FROM {t} ORDER BY id LIMIT {n} FOR UPDATE SKIP LOCKED) "
        "RETURNING id, message_id, exchange, routing_key, payload"
    ).format(t=sql.Identifier(table), n=sql.Literal(limit))


def run(dsn: str, table: str, amqp_url: str) -> int:
    """Move rows until SIGTERM; returns how many were published and committed."""
    work = session.connect(dsn, application_name="outbox-bench-poller")
    wakeups = WakeupListener(dsn, table)
    publisher = Publisher(amqp_url)
    publisher.connect()
    statement = claim(table, BATCH_SIZE)
    moved = busy = 0
    print("ready", flush=True)
    while not _stop:
        work.execute("BEGIN")
        rows = work.execute(statement).fetchall()
        if not rows:
            work.execute("ROLLBACK")
            busy = 0
            if not wakeups.wanting and wakeups.want_wakeups():
                continue
            # Serve the broker connection while waiting for a NOTIFY or the next poll
            # (the claim).
            if publisher.wait(wakeups.poll_pause(1.0), wake_fd=wakeups.fileno()):
                wakeups.take_notifications()
            continue
        busy += 1
        if busy == 2 and wakeups.wanting:
            wakeups.stop_wanting_wakeups()
        messages = [
            Message(r["exchange"], r["routing_key"], r["payload"], str(r["message_id"]))
            for r in rows
        ]
        deliveries = publisher.confirmed(publisher.send(messages), CONFIRM_TIMEOUT)
        if all(d.outcome is Outcome.ACCEPTED for d in deliveries):
            work.execute("COMMIT")
            moved += len(rows)
        else:
            work.execute("ROLLBACK")
    publisher.close()
    work.close()
    wakeups.close()
    return moved


def main() -> None:
    signal.signal(signal.SIGTERM, _stopping)
    signal.signal(signal.SIGINT, _stopping)
    env = os.environ
    moved = run(env["OUTBOX_DSN"], env.get("OUTBOX_TABLE", "outbox"), env["OUTBOX_AMQP_URL"])
    print(f"moved {moved}", file=sys.stderr)


if __name__ == "__main__":
    main()
