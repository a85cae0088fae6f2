"""What operators use around running relays and consumers: ``status``, the one
quarantine (``quarantine``) and its two kinds, dead letters (``deadletters``) and
parked messages (``parked``), and ``upgrade`` (``outbox init``: the online
migration, with dead relays' batches resolved first), and ``fleet``: ``status`` and
``resolve`` over many databases (``--targets``/``--discover``).  The HTTP endpoints
(``/metrics``, ``/healthz``, ``/readyz``) are served by each process itself (``outbox.probes``).

May import: ``outbox.fleet``, ``outbox.relay``, ``outbox.inbox``, ``resolver``, ``outbox.amqp``,
``outbox.db`` and the plain modules of ``outbox``.
"""
