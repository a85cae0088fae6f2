"""The consumer side: ``outbox consume`` and its inbox, for exactly-once effects.

Owns the consumer process (``process``: connect, receive, settle, hold failed
messages for their retry, reconnect, stop; ``serve`` and ``consume``), the steps of
each message over the store and broker ports, with the crash table (``steps``), the
pure decisions (``planning``: how a message is applied, why it is parked, retry
delays), the handler a command names (``handlers``), the consumer's counters
(``stats``), its settings (``settings``), which messages the consumer stores before
the broker can drop them and how (``custody``), the consumer's metrics and health
endpoints (``metrics``) and ``outbox parked`` (``parked``).

Its store (the inbox, attempts, custody and parked tables' statements) is
``outbox.db.inbox``, beside the relay's; its broker code (kombu and py-amqp I/O, the
AMQP property list, what a handler sees of a delivery, the queue's policies) is
``outbox.amqp.consumer`` and its neighbours, beside the relay's publisher.

May import: ``outbox.db`` (its store, connections, the shared SQL loader),
``outbox.amqp`` (its broker) and the plain modules of ``outbox``; never the relay.

``from outbox.inbox import consume`` is the public entry point (``consume_async``
for ``async def`` handlers inside an application's event loop: ``aio``).
"""

# The public names load the process (and kombu, which imports Django when it is
# installed) on first use, so that ``outbox.inbox.settings`` and the CLI's options do
# not pay for it (PEP 562).
import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from outbox.amqp.message import InboxMessage
    from outbox.db.inbox import DEFAULT_INBOX_TABLE
    from outbox.inbox.aio import consume_async
    from outbox.inbox.handlers import HandlerNotFound, load_handler
    from outbox.inbox.process import Inbox, consume
    from outbox.inbox.settings import ConsumerSettings
    from outbox.inbox.stats import ConsumerStats

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
    "DEFAULT_INBOX_TABLE": "outbox.db.inbox",
    "ConsumerSettings": "outbox.inbox.settings",
    "ConsumerStats": "outbox.inbox.stats",
    "HandlerNotFound": "outbox.inbox.handlers",
    "Inbox": "outbox.inbox.process",
    "InboxMessage": "outbox.amqp.message",
    "consume": "outbox.inbox.process",
    "consume_async": "outbox.inbox.aio",
    "load_handler": "outbox.inbox.handlers",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        module = importlib.import_module(_HOMES[name])
        return getattr(module, name)
    raise AttributeError(f"module 'outbox.inbox' has no attribute {name!r}")
