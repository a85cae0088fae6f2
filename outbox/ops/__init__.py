"""What operators use around running relays: ``status``, dead letters
(``deadletters``) and ``upgrade`` (``outbox init``: the online migration, with dead
relays' batches resolved first).  The HTTP endpoints (``/metrics``, ``/healthz``,
``/readyz``) are served by each process itself (``outbox.probes``).

May import: ``outbox.relay``, ``outbox.inbox``, ``resolver``, ``outbox.amqp``,
``outbox.db`` and the plain modules of ``outbox``.
"""
