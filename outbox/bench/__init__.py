"""``outbox bench``: the relay and the consumer measured against bare clients.

``run`` is the entry point; ``load``, ``ordering``, ``memory``, ``consume``,
``returned`` (what custody costs the consumer per message) and ``commits`` (what
the wake-up trigger costs the applications' commits) are the scenarios, ``deadrows``
the claim's cost behind the dead rows a held horizon keeps,
``drain`` one relay draining a backlog behind them against a fresh table,
``horizon`` the relay while a snapshot, a slot or a prepared transaction holds the
horizon, ``scheduled`` the rows due now beside a million scheduled ones (and the
lateness of rows coming due), ``autovacuum`` what the outbox table's own
autovacuum parameters do once it has held a backlog, ``retries`` what a retry
queue would cost the consumer (the broker's head-of-line expiry and
dead-lettering), ``soak`` an hour of load with
a fault every few minutes (on a private broker, ``outbox.amqp.devnode``), over
the ``harness`` (servers, relays as subprocesses, the bare publisher, one run);
``publishers`` the scaling grid's N bare publishers sending in parallel;
``poller`` is the latency run's baseline (the relay's loop without two-phase commit).
Benchmarks print figures, they never assert timings.  ``standby`` is the hot
standby whose feedback holds the horizon through a physical slot (``horizon``'s
``physical-slot`` holder).  ``fleet`` is many databases on one cluster: a relay
for one database against one ``outbox relay --targets`` for fifty (and two), idle,
with a backlog in one of them, with targets changed while it runs.

May import: ``outbox.fleet``, ``outbox.relay``, ``outbox.inbox``, ``outbox.amqp``, ``outbox.db``,
``resolver`` and the plain modules of ``outbox``.
"""
