"""The resolver's decision for one prepared transaction: a pure function.

============================  ===========  ==========================================
owner of the batch            evidence     action
============================  ===========  ==========================================
not a batch of this outbox    (not read)   SKIP: foreign, never touched
alive (lock held, fresh       (not read)   WAIT: the relay finishes its own batch
heartbeat)
dead (control session gone)   in ledger    COMMIT: every message is on the broker
dead                          absent       ROLLBACK: rows are published again
presumed dead (lock held but  in ledger    COMMIT, after ending its session
heartbeat ≥ relay_timeout)
presumed dead                 absent       ROLLBACK, after ending its session
============================  ===========  ==========================================

"Dead" is certain: the advisory lock dies with the relay's database session.  A
partitioned relay keeps its session (and lock) until TCP gives up, so a heartbeat
older than ``relay_timeout`` is the fallback; such a relay stops committing on its
own before that age (``Relay._may_commit``).  A lock held with no registry row
(registration in progress) counts as alive until the batch itself is older than
``relay_timeout``.
"""

from __future__ import annotations

import dataclasses
import enum

from outbox import gid as gids


class Action(enum.Enum):
    COMMIT = "commit"
    ROLLBACK = "rollback"
    WAIT = "wait"
    SKIP = "skip"


class Owner(enum.Enum):
    FOREIGN = "foreign"  # not one of this outbox's batches (or another database)
    ALIVE = "alive"
    DEAD = "dead"
    PRESUMED_DEAD = "presumed_dead"


@dataclasses.dataclass(frozen=True)
class Decision:
    action: Action
    owner: Owner
    why: str


def owner_state(
    *,
    ours: bool,
    lock_held: bool,
    heartbeat_age: float | None,
    batch_age: float,
    relay_timeout: float,
) -> Owner:
    if not ours:
        return Owner.FOREIGN
    if not lock_held:
        return Owner.DEAD
    age = heartbeat_age if heartbeat_age is not None else batch_age
    return Owner.PRESUMED_DEAD if age >= relay_timeout else Owner.ALIVE


def decide(owner: Owner, evidence: bool | None) -> Decision:
    """What to do with a batch, given its owner and whether the ledger has its gid.

    ``evidence`` is None when the ledger was not read (it is only read for
    batches whose owner is dead).
    """
    if owner is Owner.FOREIGN:
        return Decision(Action.SKIP, owner, "not a batch of this outbox")
    if owner is Owner.ALIVE:
        return Decision(Action.WAIT, owner, "its relay is alive and will finish it")
    if evidence is None:
        raise ValueError("a dead relay's batch needs the ledger's evidence")
    prefix = "relay gone" if owner is Owner.DEAD else "relay presumed partitioned"
    if evidence:
        return Decision(Action.COMMIT, owner, f"{prefix}; ledger records the whole batch")
    return Decision(Action.ROLLBACK, owner, f"{prefix}; no ledger record, rows will be resent")


def is_ours(gid: str, *, local: bool, table: str) -> bool:
    """Whether a prepared transaction is a batch of this outbox table's relays, in
    this database: the only ones a resolver may ever finish (DESIGN, invariant 5)."""
    parsed = gids.parse(gid)
    return local and parsed is not None and parsed.table == table
