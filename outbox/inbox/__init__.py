"""The consumer side: ``outbox consume`` and its inbox, for exactly-once effects.

Owns the consume loop and its settings (``loop``), the kombu broker code
(``broker``), the inbox and parked tables (``store``, ``inbox.sql``), what a
handler sees of a delivery and what is kept of a parked one (``message``), the
consumer's metrics and health endpoints (``metrics``) and ``outbox parked``
(``parked``).

May import: ``outbox.db`` (the shared SQL loader) and the plain modules of
``outbox``; never the relay.

``from outbox.inbox import consume`` is the public entry point.
"""

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
    "load_handler",
]
