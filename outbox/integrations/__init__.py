"""Enqueueing from the frameworks applications already use.

Each integration is an optional extra, imported only when the application imports
it: ``outbox.integrations.sqlalchemy`` (``outbox-relay[sqlalchemy]``) and
``outbox.integrations.django`` (``outbox-relay[django]``). Both write the row with
the same statement and parameters as ``outbox.enqueue``, on the connection of the
application's current transaction, and never commit.

May import: ``outbox.db`` (the Django migrations run ``outbox init``'s migrations)
and the plain modules of ``outbox``.
"""
