"""``outbox bench``: the relay and the consumer measured against bare clients.

``run`` is the entry point; ``load``, ``ordering``, ``memory`` and ``consume`` are
the scenarios.  Benchmarks print figures, they never assert timings.

May import: ``outbox.relay``, ``outbox.inbox``, ``outbox.amqp``, ``outbox.db``,
``resolver`` and the plain modules of ``outbox``.
"""
