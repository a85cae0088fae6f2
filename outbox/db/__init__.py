"""PostgreSQL for the relay, the resolver and the tools: the only package that
runs the outbox's statements (psycopg 3).

Owns the sessions and their error translation (``store``), the SQL
(``queries.sql`` through ``queries``), the versioned schema (``migrate`` and
``schema/*.sql``), the privileges each command needs (``privileges``), the
replication check (``replication``) and throw-away clusters for demos and tests
(``devcluster``).

May import: the plain modules of ``outbox`` only.
"""

from outbox.db.batches import BatchStore
from outbox.db.deadletters import DeadLetterStore
from outbox.db.relays import ControlSession, WakeupListener

__all__ = ["BatchStore", "ControlSession", "DeadLetterStore", "WakeupListener"]
