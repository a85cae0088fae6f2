"""PostgreSQL for the relay, the resolver, the consumer and the operators' tools
(psycopg 3): every statement of the product, except the application's own INSERT
(``outbox.enqueue`` and the integrations, on the application's connection).

Owns the one session mechanism (``session``: connect, loss detection, error
translation, with a daemon's or an operator's hints), the relay's
batch store (``batches``), where its claims start (``front``: the low-water mark
and the late rows), how claimed rows load
(``rows``), the dead letters (``deadletters``), the consumer's inbox, attempts,
custody and parked tables (``inbox``, ``inbox.sql``: the consumer's store, with
what it writes of a parked message and of one in custody), the relay registry and wake-ups
(``relays``), the mover of scheduled rows (``scheduled``), the SQL
(``queries.sql`` through ``queries``), the versioned schema, migrated online (``migrate`` and
``schema/*.sql``), the privileges each command needs (``privileges``), the
replication check (``replication``), what holds the MVCC horizon and the outbox's
dead rows (``horizon``, ``horizon.sql``) and throw-away clusters for demos and tests
(``devcluster``).

May import: the plain modules of ``outbox`` only.
"""

from outbox.db.batches import BatchStore
from outbox.db.deadletters import DeadLetterStore
from outbox.db.relays import ControlSession, WakeupListener

__all__ = ["BatchStore", "ControlSession", "DeadLetterStore", "WakeupListener"]
