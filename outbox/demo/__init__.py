"""``outbox demo``: the whole path on local servers, checked end to end.

``relay`` runs the relay demo, ``inbox`` the exactly-once consumer demo, and
``reader`` is the small kombu reader both (and the tests) use to see what arrived.

May import: ``outbox.relay``, ``outbox.inbox``, ``outbox.db`` and the plain
modules of ``outbox``.
"""
