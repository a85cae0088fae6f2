"""Testing your handlers: one handler, a real database, a synthetic message.

``HandlerTester`` applies a message the way ``outbox consume`` does, without a
broker: the consumer's own ``Processor`` over its ``InboxStore`` (the same
transaction, the same checks of what the handler left, the same inbox record and
attempt counter), so a test cannot pass here and fail in production for a reason
that lies in the consumer.  What it leaves out is the broker: the ack, the retry
delay (a failed message is not applied again until you run it again) and the
queue's own policy::

    from outbox.testing import HandlerTester, make_message

    def test_on_order__records_the_order(dsn):
        with HandlerTester(dsn, handlers.on_order) as tester:
            run = tester.run(make_message({"id": 7}, routing_key="order.created"))
            assert run.outcome == "handled" and run.recorded
            again = tester.run(make_message({"id": 7}, message_id=run.message_id))
            assert again.outcome == "duplicate"

The database must be one where the inbox tables may be created (``outbox consume``
creates them too): a test database, never production's.  How to use it: the
manual's "Testing your handlers" page.

May import: ``outbox.inbox`` and the plain modules of ``outbox``.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import psycopg
from psycopg import sql

from outbox.amqp.message import InboxMessage
from outbox.db.inbox import DEFAULT_INBOX_TABLE, InboxStore
from outbox.inbox.handlers import Handler
from outbox.inbox.settings import ConsumerSettings
from outbox.inbox.stats import ConsumerStats
from outbox.inbox.steps import Processor

__all__ = ["HandlerRun", "HandlerTester", "make_message"]

# The queue (and so the consumer name) of the messages a test makes.
TEST_QUEUE = "tests"


def make_message(
    body: Any = b"",
    *,
    message_id: str | None = None,
    routing_key: str = "",
    exchange: str = "",
    headers: Mapping[str, Any] | None = None,
    ordering_key: str | None = None,
    content_type: str | None = None,
    queue: str = TEST_QUEUE,
    redelivered: bool = False,
) -> InboxMessage:
    """A delivery as a handler sees it.  ``body``: bytes as they are, anything else
    as JSON (what ``outbox.enqueue_json`` writes); ``message_id``: a new UUID unless
    given (give the same one twice to test a duplicate)."""
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
        content_type = content_type or "application/json"
    return InboxMessage(
        message_id=message_id if message_id is not None else str(uuid.uuid4()),
        body=body,
        headers=dict(headers or {}),
        exchange=exchange,
        routing_key=routing_key,
        ordering_key=ordering_key,
        redelivered=redelivered,
        queue=queue,
        content_type=content_type,
    )


@dataclasses.dataclass(frozen=True)
class HandlerRun:
    """What applying one message did."""

    message_id: str | None
    # "handled" (its effect committed), "duplicate" (its id was recorded before: no
    # effect), "retry" (the handler failed; the consumer would apply it again later)
    # or "parked" (given up: see ``outbox parked``).
    outcome: str
    # Its id is in the inbox: a later copy is skipped (handled and parked messages).
    recorded: bool
    # Failed attempts counted so far (0 once the message is handled or parked).
    attempts: int
    # The last failure recorded for it (while it waits for a retry, or parked).
    error: str | None


class HandlerTester:
    """Runs ``handler`` (``handler(conn, message)``, as ``outbox consume`` calls it)
    on messages, one at a time, against the database ``dsn``; creates the inbox
    tables there if they are missing."""

    def __init__(
        self,
        dsn: str,
        handler: Handler,
        *,
        inbox_table: str = DEFAULT_INBOX_TABLE,
        queue: str = TEST_QUEUE,
        max_attempts: int = 5,
    ) -> None:
        self.dsn = dsn
        self.settings = ConsumerSettings(
            queue=queue, dsn=dsn, inbox_table=inbox_table, max_attempts=max_attempts
        )
        self.stats = ConsumerStats()
        self.store = InboxStore(
            dsn, inbox_table, self.settings.consumer, application_name="outbox-testing"
        )
        try:
            self.store.ensure_schema()
        except BaseException:
            self.store.close()
            raise
        self.processor = Processor(self.store, handler, self.settings, self.stats)

    def run(self, message: InboxMessage) -> HandlerRun:
        """Apply ``message`` as the consumer would, and say what it did."""
        [(outcome, _delay)] = self.processor.process_batch([message])
        recorded, attempts, error = self._inbox_of(message.message_id)
        return HandlerRun(message.message_id, outcome.value, recorded, attempts, error)

    def _inbox_of(self, message_id: str | None) -> tuple[bool, int, str | None]:
        """What the inbox tables hold for ``message_id``: recorded, failed attempts,
        the last failure (the attempt counter's or the parked row's)."""
        if message_id is None:
            return False, 0, None
        table = self.settings.inbox_table
        query = sql.SQL(
            "SELECT EXISTS (SELECT FROM {inbox} WHERE consumer = %(c)s AND message_id = %(m)s),"
            " a.attempts, coalesce(a.last_error,"
            "  (SELECT error FROM {parked} WHERE consumer = %(c)s AND message_id = %(m)s))"
            " FROM (SELECT) AS one"
            " LEFT JOIN {attempts} a ON a.consumer = %(c)s AND a.message_id = %(m)s"
        ).format(
            inbox=sql.Identifier(table),
            attempts=sql.Identifier(f"{table}_attempts"),
            parked=sql.Identifier(f"{table}_parked"),
        )
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            row = conn.execute(query, {"c": self.settings.consumer, "m": message_id}).fetchone()
        assert row is not None  # one row, always
        return bool(row[0]), int(row[1] or 0), row[2]

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> HandlerTester:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
