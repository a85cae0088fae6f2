"""RabbitMQ: every line of code that talks to it, for the relay and the resolver
(pika) and for the consumer (kombu and py-amqp).  The bench's bare publisher uses
pika directly, as the baseline it measures.

Owns the bytes of a publish (``frames``, pure), confirm and return bookkeeping
(``confirms``, pure), the publisher's I/O (``publisher``), failing over across the
nodes of a cluster (``failover``, pure decisions) and the ledger stream that holds
the evidence of finished batches (``ledger``), and a private node for what must stop
or restart a broker, the soak and the fault tests (``devnode``).  The ledger sits
here, below both the relay and the resolver, because both read it.

The consumer's side: its connection's I/O (``consumer``: connect, declare, deliver,
ack, reject, heartbeats, the frame reader, and the queue publisher of ``outbox
parked retry``), the AMQP property list read as it arrived (``properties``, pure),
what a handler sees of a delivery (``message``, pure) and what the queue's own
policy (type, delivery limit, TTL) means for a message in hand (``policy``, pure).

May import: the plain modules of ``outbox`` only.
"""

from outbox.amqp.ledger import finished_gids, record
from outbox.amqp.publisher import Publisher

__all__ = ["Publisher", "finished_gids", "record"]
