"""One resolver pass: scan, gather evidence, decide, apply.

Races are harmless by construction: COMMIT/ROLLBACK PREPARED on a gid that another
finisher already took returns "finished elsewhere" (SQLSTATE 42704), or "held
elsewhere" while that finisher is still at it (55000: looked at again next pass), and
both finishers decide from the same evidence rule, so they never disagree about a
batch whose owner is dead.

The hand-over (``resolver/decide.py``): the batches of a dead relay id are finished
only under that id's hand-over lock (``outbox.gid.HANDOVER_LOCK_CLASS``), taken
before the relay's liveness is looked at again and before the ledger is read, and
held until they are finished.  A relay that lost its control session but not its
process takes its id back under the same lock, so a resolver never rolls back a
batch whose ledger record the relay, holding its id again, is about to write.  An
id whose hand-over lock someone else holds is left to them ("held_elsewhere").
What a crash of the resolver leaves: its session ends, the lock with it; a
COMMIT/ROLLBACK PREPARED it had sent finishes or not, and the next finisher finds
the gid gone or present (55000 while the cut-off backend still runs it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
from collections.abc import Mapping

from outbox import gid as gids
from outbox.amqp import ledger
from outbox.config import Settings
from outbox.db import migrate, privileges
from outbox.db.batches import BatchStore, PreparedBatch, RelayLiveness
from outbox.errors import GidHeld, OutboxError, OutcomeUnknown
from outbox.events import emit
from resolver.decide import Action, Decision, Owner, decide, is_ours, owner_state

log = logging.getLogger("outbox.resolver")


@dataclasses.dataclass(frozen=True)
class Resolution:
    gid: str
    age_seconds: float
    decision: Decision
    evidence: bool | None
    # committed | rolled_back | finished_elsewhere | held_elsewhere | waiting | skipped | planned
    outcome: str

    @property
    def finished(self) -> bool:
        return self.outcome in ("committed", "rolled_back")

    def as_dict(self) -> dict[str, object]:
        return {
            "gid": self.gid,
            "age_seconds": round(self.age_seconds, 3),
            "owner": self.decision.owner.value,
            "action": self.decision.action.value,
            "evidence": self.evidence,
            "why": self.decision.why,
            "outcome": self.outcome,
        }


def run_pass(
    settings: Settings, *, dry_run: bool = False, application_name: str = "outbox-resolve"
) -> list[Resolution]:
    """One pass on a session of its own, as ``outbox resolve`` and the console run it:
    privileges and schema version checked first (MissingPrivileges, SchemaTooNew)."""
    store = BatchStore(
        settings.dsn,
        settings.table,
        application_name=application_name,
        connect_timeout=settings.connect_timeout,
        statement_timeout=settings.statement_timeout,
        lock_timeout=settings.lock_timeout,
        client_deadline=True,
    )
    try:
        # Privileges first: reading the schema version needs one of them.
        store.check_privileges(privileges.RESOLVE, "outbox resolve")
        migrate.refuse_newer(migrate.version_of(store), settings.table)
        return resolve(store, settings, dry_run=dry_run)
    finally:
        store.close()


def resolve(store: BatchStore, settings: Settings, *, dry_run: bool = False) -> list[Resolution]:
    """Resolve every in-doubt batch of dead relays; report on all the others."""
    batches = store.prepared_batches()
    ours = [b for b in batches if is_ours(b.gid, local=b.local, table=settings.table)]
    relay_ids = sorted({_relay_id(b) for b in ours})
    liveness = store.relay_liveness(relay_ids)
    owners = _owners(batches, liveness, settings)
    dead_ids = sorted({_relay_id(b) for b in ours if owners[b.gid] in _DEAD})
    handed_over: list[str] = []
    try:
        if dead_ids and not dry_run:
            handed_over = [r for r in dead_ids if store.take_handover(r)]
            # Under the hand-over lock: a relay that took its id back since the first
            # look is alive now, and can no longer take it while we finish its batches.
            liveness = {**liveness, **store.relay_liveness(handed_over)}
            owners = _owners(batches, liveness, settings)
        elif dry_run:
            handed_over = dead_ids
        return _resolve_handed_over(
            store, settings, batches, owners, liveness, handed_over, dry_run
        )
    finally:
        for relay_id in handed_over if not dry_run else ():
            # A lost session has let the lock go with it.
            with contextlib.suppress(OutboxError):
                store.release_handover(relay_id)


_DEAD = (Owner.DEAD, Owner.PRESUMED_DEAD)


def _relay_id(batch: PreparedBatch) -> str:
    parsed = gids.parse(batch.gid)
    assert parsed is not None, "only this outbox's batches have a relay id"
    return parsed.relay_id


def _owners(
    batches: list[PreparedBatch], liveness: Mapping[str, RelayLiveness], settings: Settings
) -> dict[str, Owner]:
    owners: dict[str, Owner] = {}
    for batch in batches:
        parsed = gids.parse(batch.gid)
        alive = liveness.get(parsed.relay_id) if parsed else None
        owners[batch.gid] = owner_state(
            ours=is_ours(batch.gid, local=batch.local, table=settings.table),
            lock_held=bool(alive and alive.lock_held),
            heartbeat_age=alive.heartbeat_age if alive else None,
            batch_age=batch.age_seconds,
            relay_timeout=settings.relay_timeout,
            server_age=alive.server_age if alive else None,
        )
    return owners


def _resolve_handed_over(
    store: BatchStore,
    settings: Settings,
    batches: list[PreparedBatch],
    owners: Mapping[str, Owner],
    liveness: Mapping[str, RelayLiveness],
    handed_over: list[str],
    dry_run: bool,
) -> list[Resolution]:
    """Decide and finish, the ledger read after the hand-over locks were taken: any
    record the relay wrote before we hold its id is in it (or is the crash table's
    "ledger record sent": rolled back, duplicates = batch)."""
    orphans = [
        b
        for b in batches
        if owners[b.gid] in _DEAD
        and is_ours(b.gid, local=b.local, table=settings.table)
        and _relay_id(b) in handed_over
    ]
    recorded: set[str] = set()
    if orphans:
        oldest = min(b.prepared for b in orphans)
        since = oldest - datetime.timedelta(seconds=settings.ledger_clock_skew)
        recorded = ledger.finished_gids(
            settings.amqp_url,
            settings.ledger_queue,
            since=since,
            timeout=settings.publish_timeout,
            connect_timeout=settings.connect_timeout,
            ca_file=settings.amqp_ca_file,
        )

    results = []
    for batch in batches:
        owner = owners[batch.gid]
        evidence = batch.gid in recorded if batch in orphans else None
        decision = decide(owner, evidence, handed_over=owner not in _DEAD or batch in orphans)
        outcome = _apply(store, batch, decision, liveness, dry_run)
        results.append(Resolution(batch.gid, batch.age_seconds, decision, evidence, outcome))
    if not dry_run and orphans:
        store.forget_dead_relays(older_than=settings.relay_timeout)
    return results


def _apply(
    store: BatchStore,
    batch: PreparedBatch,
    decision: Decision,
    liveness: Mapping[str, RelayLiveness],
    dry_run: bool,
) -> str:
    if decision.action is Action.SKIP:
        return "skipped"
    if decision.action is Action.WAIT:
        return "waiting" if decision.owner not in _DEAD else "held_elsewhere"
    if dry_run:
        return "planned"
    if decision.owner is Owner.PRESUMED_DEAD:
        parsed = gids.parse(batch.gid)
        state = liveness.get(parsed.relay_id) if parsed else None
        pid = state.backend_pid if state else None
        if pid is not None:
            # Make the partitioned relay's death certain before finishing its work.
            store.terminate_backend(pid)
    commit = decision.action is Action.COMMIT
    try:
        done = store.finish(batch.gid, commit=commit)
    except GidHeld:
        # Another resolver (or the relay's own lost session) is finishing it right
        # now; if that fails, the next pass finds the batch again.
        emit(log, "resolver.held_elsewhere", logging.INFO, gid=batch.gid)
        return "held_elsewhere"
    except OutcomeUnknown:
        emit(log, "resolver.outcome_unknown", logging.WARNING, gid=batch.gid)
        raise
    outcome = ("committed" if commit else "rolled_back") if done else "finished_elsewhere"
    emit(
        log,
        "batch.resolved",
        logging.WARNING,
        gid=batch.gid,
        action=decision.action.value,
        outcome=outcome,
        why=decision.why,
    )
    return outcome
