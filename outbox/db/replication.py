"""Is the outbox database safe to fail over?  A pure decision over what the primary says.

A prepared transaction reaches a standby before PREPARE returns only when that
standby is synchronous.  With asynchronous replication a failover can lose the
last transactions the primary committed: an application's outbox row whose
message the relay already published (a message with no row behind it), or a
COMMIT PREPARED (the batch is in doubt again on the new primary and is resolved
from the ledger).  So a database that streams to standbys without a synchronous
one gets a warning from ``outbox status`` and in the relay's start-up log.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Replication:
    standbys: int  # walsenders to standbys (pg_stat_replication rows)
    synchronous: int  # of which sync_state is 'sync' or 'quorum'
    hidden: int  # of which the role may not see the state (needs pg_monitor)


def warning(replication: Replication) -> str | None:
    """One line for the operator, or None when there is nothing to say."""
    if replication.standbys == 0 or replication.synchronous > 0:
        return None
    if replication.hidden == replication.standbys:
        return (
            f"the database streams to {replication.standbys} standby(s) and this role cannot "
            "see whether one is synchronous (grant it pg_monitor to check)"
        )
    return (
        f"the database streams to {replication.standbys} standby(s), none synchronous: a "
        "failover can lose committed outbox rows whose messages were already published; "
        "set synchronous_standby_names on the primary "
        "(docs/how-to/clusters.md#postgresql-a-primary-with-a-synchronous-standby)"
    )
