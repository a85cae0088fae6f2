"""Finish in-doubt relay batches from broker-side evidence.

Scan ``pg_prepared_xacts`` (``apply.resolve``) → decide for each batch, purely
(``decide.decide``) → COMMIT PREPARED or ROLLBACK PREPARED.  Every relay runs a
pass at start-up and every ``resolve_interval``; ``outbox resolve`` and
``python -m resolver`` run one pass for operators.

May import: ``outbox.amqp`` (the ledger), ``outbox.db`` and the plain modules of
``outbox``; never ``outbox.relay`` (the relay calls the resolver, not the reverse).
"""

from resolver.apply import Resolution, resolve, run_pass
from resolver.decide import Action, Decision, Owner, decide, is_ours

__all__ = ["Action", "Decision", "Owner", "Resolution", "decide", "is_ours", "resolve", "run_pass"]
