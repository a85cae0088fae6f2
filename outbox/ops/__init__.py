"""What operators use around running relays: ``status``, dead letters, and the
relay's HTTP endpoints (``/metrics``, ``/healthz``, ``/readyz``).

May import: ``outbox.relay``, ``outbox.inbox``, ``resolver``, ``outbox.amqp``,
``outbox.db`` and the plain modules of ``outbox``.
"""
