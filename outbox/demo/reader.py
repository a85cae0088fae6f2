"""Consumer-side helpers (kombu): topology and duplicate-dropping consumers.

The relay delivers every message at least once, and more than once only after a
crash or broker outage mid-batch (docs/explanation/guarantee.md).  Consumers drop the
duplicates by ``message_id``; ``Deduplicator`` is the in-memory version of that,
and ``receive`` collects messages for scripts, demos and tests.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import socket
import time
from collections.abc import Iterator
from typing import Any

from kombu.connection import Connection
from kombu.entity import Exchange, Queue
from kombu.messaging import Consumer

from outbox import urls
from outbox.errors import BrokerUnavailable


@dataclasses.dataclass(frozen=True)
class Received:
    message_id: str
    body: bytes
    exchange: str
    routing_key: str
    properties: dict[str, Any]
    headers: dict[str, Any]


@contextlib.contextmanager
def _connection(amqp_url: str) -> Iterator[Connection]:
    """A connected kombu connection, or ``BrokerUnavailable`` (not kombu's traceback)."""
    conn = Connection(amqp_url)
    try:
        conn.connect()
    except (*conn.connection_errors, *conn.channel_errors) as exc:
        conn.release()
        where = urls.parse_amqp_urls(amqp_url)[0].describe()
        raise BrokerUnavailable(
            f"cannot connect to RabbitMQ at {where}: {exc}",
            "check --amqp-url / OUTBOX_AMQP_URL and that the broker is running",
        ) from exc
    try:
        yield conn
    finally:
        conn.release()


def declare(
    amqp_url: str,
    *,
    exchange: str,
    queue: str,
    binding_key: str = "#",
    exchange_type: str = "topic",
) -> None:
    """Declare a durable exchange and a durable queue bound to it."""
    with _connection(amqp_url) as conn:
        channel = conn.channel()
        ex = Exchange(exchange, type=exchange_type, durable=True)
        Queue(queue, ex, routing_key=binding_key, durable=True)(channel).declare()
        channel.close()


def delete(amqp_url: str, *, exchange: str | None = None, queue: str | None = None) -> None:
    with _connection(amqp_url) as conn:
        channel = conn.channel()
        if queue:
            channel.queue_delete(queue)
        if exchange:
            channel.exchange_delete(exchange)
        channel.close()


def receive(
    amqp_url: str, queue: str, *, expected: int, timeout: float = 30.0, idle: float = 1.0
) -> list[Received]:
    """Consume (and ack) until ``expected`` messages arrived and ``idle`` s passed quietly,
    or ``timeout``.  Waiting a little past ``expected`` reveals duplicates."""
    received: list[Received] = []

    def on_message(body: Any, message: Any) -> None:
        props = dict(message.properties)
        received.append(
            Received(
                message_id=str(props.get("message_id")),
                body=message.body if isinstance(message.body, bytes) else bytes(message.body),
                exchange=message.delivery_info.get("exchange", ""),
                routing_key=message.delivery_info.get("routing_key", ""),
                properties=props,
                headers=dict(message.headers or {}),
            )
        )
        message.ack()

    deadline = time.monotonic() + timeout
    with (
        _connection(amqp_url) as conn,
        Consumer(
            conn,
            [Queue(queue, no_declare=True)],
            callbacks=[on_message],
            accept=None,
            prefetch_count=500,
        ),
    ):
        quiet_since = time.monotonic()
        while time.monotonic() < deadline:
            before = len(received)
            with contextlib.suppress(socket.timeout):
                conn.drain_events(timeout=0.2)
            if len(received) != before:
                quiet_since = time.monotonic()
            elif len(received) >= expected and time.monotonic() - quiet_since >= idle:
                break
    return received


class Deduplicator:
    """Remembers the last ``capacity`` message ids; ``first_time`` is False for repeats.

    In production keep the ids in the consumer's own database, in the same
    transaction as the consumer's effect; this one is for stateless consumers
    whose duplicates can only come from a recent relay crash.
    """

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()

    def first_time(self, message_id: str) -> bool:
        if message_id in self._seen:
            self._seen.move_to_end(message_id)
            return False
        self._seen[message_id] = None
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return True
