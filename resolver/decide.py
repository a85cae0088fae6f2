"""The resolver's decision for one prepared transaction: a pure function.

============================  ===========  ==========================================
owner of the batch            evidence     action
============================  ===========  ==========================================
not a batch of this outbox    (not read)   SKIP: foreign, never touched
alive (lock held, fresh       (not read)   WAIT: the relay finishes its own batch
heartbeat)
reconnecting (lock gone with  (not read)   WAIT: the relay, if its process lives,
the server: last heartbeat                 takes its id back and finishes its batches
before the server's start or               itself (its confirms are its own)
promotion, < relay_timeout
ago)
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

"Reconnecting": a server restart or a failover ends every session, so a lock gone
with the server says nothing about the relay.  A relay whose process lived takes
its id back (``outbox.relay.liveness``), usually within a second of the server's
return; it is given ``relay_timeout`` from the server's start or promotion, as a
partitioned relay is given ``relay_timeout`` from its last heartbeat.  A relay
killed before or with the server costs that wait, nothing more: its batches are
then resolved from the ledger as a dead relay's.

The hand-over (``apply``): a resolver acts on a dead relay's batches only while
it holds that relay id's hand-over lock, taken before it reads the relay's
liveness and the ledger; the relay takes its id back only under the same lock.
What each side may meet:

=======================================  ==========================================
the race                                 outcome
=======================================  ==========================================
the relay took its id back first         the resolver sees it alive: WAIT
the resolver holds the hand-over lock    the relay retries; then finds the gids the
                                         resolver finished gone (committed from the
                                         ledger, or rolled back without a record:
                                         the relay never wrote one) and keeps the
                                         rest
the relay wrote a ledger record, then    the resolver reads the record: COMMIT; the
lost its session (the server crashed)    relay's own COMMIT PREPARED then finds the
                                         gid gone (42704): finished elsewhere
the relay's id lost for good (a new id   resolved from the ledger as a dead relay's
after relay_timeout, a new process)
=======================================  ==========================================

The resolver never commits without a ledger record, and the relay writes one only
after every confirm of the batch: no side commits a batch the broker did not
confirm.  And no resolver rolls back a batch while the relay, holding its id, may
still write its record: a confirmed batch the relay keeps is committed.
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
    RECONNECTING = "reconnecting"  # its lock went with the server: it may take it back
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
    server_age: float | None = None,
) -> Owner:
    """``server_age``: set when the relay's last heartbeat predates this server's
    start or promotion, seconds since then (``BatchStore.relay_liveness``)."""
    if not ours:
        return Owner.FOREIGN
    if not lock_held:
        if server_age is not None and server_age < relay_timeout:
            return Owner.RECONNECTING
        return Owner.DEAD
    age = heartbeat_age if heartbeat_age is not None else batch_age
    return Owner.PRESUMED_DEAD if age >= relay_timeout else Owner.ALIVE


def decide(owner: Owner, evidence: bool | None, *, handed_over: bool = True) -> Decision:
    """What to do with a batch, given its owner and whether the ledger has its gid.

    ``evidence`` is None when the ledger was not read (it is only read for
    batches whose owner is dead, once their relay id is ``handed_over``: this
    resolver holds its hand-over lock).
    """
    if owner is Owner.FOREIGN:
        return Decision(Action.SKIP, owner, "not a batch of this outbox")
    if owner is Owner.ALIVE:
        return Decision(Action.WAIT, owner, "its relay is alive and will finish it")
    if not handed_over and owner in (Owner.DEAD, Owner.PRESUMED_DEAD):
        return Decision(
            Action.WAIT, owner, "another resolver, or its relay, holds its hand-over lock"
        )
    if owner is Owner.RECONNECTING:
        return Decision(
            Action.WAIT, owner, "its session ended with the server; its relay may take it back"
        )
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
