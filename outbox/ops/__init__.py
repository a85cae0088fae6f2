"""What operators use around running relays: ``status``, dead letters, the
relay's HTTP endpoints (``/metrics``, ``/healthz``, ``/readyz``) and ``upgrade``
(``outbox init``: the online migration, with dead relays' batches resolved first).

May import: ``outbox.relay``, ``outbox.inbox``, ``resolver``, ``outbox.amqp``,
``outbox.db`` and the plain modules of ``outbox``.
"""
