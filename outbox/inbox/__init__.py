"""The consumer side: ``outbox consume`` and its inbox, for exactly-once effects.

Owns the consume loop (``loop``: the steps of each message, over the store and
broker ports, and the process around them), its settings (``settings``), the
kombu broker code (``broker``) and the AMQP property list read as it arrived
(``properties``), the inbox and parked tables (``store``: statements only,
``inbox.sql``), what a handler sees of a delivery and what is kept of a parked
one (``message``), what the queue's own policy (type, delivery limit, TTL) means
for a message in hand (``policy``), the consumer's metrics and health endpoints
(``metrics``) and ``outbox parked`` (``parked``).

May import: ``outbox.db`` (connections and the shared SQL loader) and the plain
modules of ``outbox``; never the relay.

``from outbox.inbox import consume`` is the public entry point (``consume_async``
for ``async def`` handlers inside an application's event loop: ``aio``).
"""

# The public names load the loop (and kombu, which imports Django when it is
# installed) on first use, so that ``outbox.inbox.store`` and the CLI's options do
# not pay for it (PEP 562).
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from outbox.inbox.aio import consume_async
    from outbox.inbox.loop import (
        DEFAULT_INBOX_TABLE,
        ConsumerSettings,
        ConsumerStats,
        HandlerNotFound,
        Inbox,
        InboxMessage,
        consume,
        load_handler,
    )

__all__ = [
    "DEFAULT_INBOX_TABLE",
    "ConsumerSettings",
    "ConsumerStats",
    "HandlerNotFound",
    "Inbox",
    "InboxMessage",
    "consume",
    "consume_async",
    "load_handler",
]


def __getattr__(name: str) -> Any:
    if name == "consume_async":
        from outbox.inbox import aio

        return aio.consume_async
    if name in __all__:
        from outbox.inbox import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'outbox.inbox' has no attribute {name!r}")
