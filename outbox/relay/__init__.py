"""The relay: the process that moves committed outbox rows to RabbitMQ.

Owns the relay process (``process``: connect, batch loop, idle wait, reconnect,
stop; ``recovery``: knocking on a lost server while backing off), one batch's
life (``batches``: claim → PREPARE → publish → record → COMMIT PREPARED), the
proof of life (``liveness``), bad-row triage and isolation (``triage``,
``isolation``), per-key ordering (``ordering``), when scheduled rows are moved
(``scheduling``), its counters (``stats``) and its
Prometheus collector and HTTP endpoints (``metrics``).

May import: ``resolver`` (the relay runs resolver passes; never the reverse),
``outbox.amqp``, ``outbox.db`` and the plain modules of ``outbox``.
"""

from outbox.relay.process import Relay, StopFlag

__all__ = ["Relay", "StopFlag"]
