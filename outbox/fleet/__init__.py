"""Many databases, one fleet: relays that serve every database of a list.

Owns which databases a fleet serves (``targets``: a targets file, or a server and
a rule that finds every database with the outbox table) and the process that
serves them all: the supervisor and its thread per database (``process``), its
``/metrics``, ``/healthz`` and ``/readyz`` (``metrics``), its life as
``outbox relay --targets`` runs it (``serving``), and the measurement of what
idle databases cost (``footprint``).

May import: ``outbox.relay`` (a fleet runs relays), ``resolver``, ``outbox.amqp``,
``outbox.db`` and the plain modules of ``outbox``.
"""
