"""The consumer side: ``outbox consume`` and its inbox, for exactly-once effects.

Owns the consumer process (``process``: connect, receive, settle, hold failed
messages for their retry, reconnect, stop; ``serve`` and ``consume``), the steps of
each message over the store and broker ports, with the crash table (``steps``), the
pure decisions (``planning``: how a message is applied, why it is parked, retry
delays), the handler a command names (``handlers``), the consumer's counters
(``stats``), its settings (``settings``), the kombu broker code (``broker``) and the
AMQP property list read as it arrived (``properties``), the inbox and parked tables
(``store``: statements only, ``inbox.sql``), what a handler sees of a delivery and
what is kept of a parked one (``message``), what the queue's own policy (type,
delivery limit, TTL) means for a message in hand (``policy``), which messages
the consumer stores before the broker can drop them and how (``custody``), the consumer's
metrics and health endpoints (``metrics``) and ``outbox parked`` (``parked``).

May import: ``outbox.db`` (connections and the shared SQL loader) and the plain
modules of ``outbox``; never the relay.

``from outbox.inbox import consume`` is the public entry point (``consume_async``
for ``async def`` handlers inside an application's event loop: ``aio``).
"""

# The public names load the process (and kombu, which imports Django when it is
# installed) on first use, so that ``outbox.inbox.store`` and the CLI's options do
# not pay for it (PEP 562).
import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from outbox.inbox.aio import consume_async
    from outbox.inbox.handlers import HandlerNotFound, load_handler
    from outbox.inbox.message import InboxMessage
    from outbox.inbox.process import Inbox, consume
    from outbox.inbox.settings import ConsumerSettings
    from outbox.inbox.stats import ConsumerStats
    from outbox.inbox.store import DEFAULT_INBOX_TABLE

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


# Where each public name lives (the module is imported on first use).
_HOMES = {
    "DEFAULT_INBOX_TABLE": "store",
    "ConsumerSettings": "settings",
    "ConsumerStats": "stats",
    "HandlerNotFound": "handlers",
    "Inbox": "process",
    "InboxMessage": "message",
    "consume": "process",
    "consume_async": "aio",
    "load_handler": "handlers",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        module = importlib.import_module(f"outbox.inbox.{_HOMES[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'outbox.inbox' has no attribute {name!r}")
