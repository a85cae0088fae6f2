"""One resolver pass: scan, gather evidence, decide, apply.

Races are harmless by construction: COMMIT/ROLLBACK PREPARED on a gid that another
finisher already took returns "finished elsewhere" (SQLSTATE 42704), or "held
elsewhere" while that finisher is still at it (55000: looked at again next pass), and
both finishers decide from the same evidence rule, so they never disagree about a
batch whose owner is dead.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Mapping

from outbox import gid as gids
from outbox.amqp import ledger
from outbox.config import Settings
from outbox.db import migrate, privileges
from outbox.db.batches import BatchStore, PreparedBatch, RelayLiveness
from outbox.errors import GidHeld, OutcomeUnknown
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
    relay_ids = sorted({gids.parse(b.gid).relay_id for b in ours})  # type: ignore[union-attr]
    liveness = store.relay_liveness(relay_ids)

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
        )

    orphans = [b for b in ours if owners[b.gid] in (Owner.DEAD, Owner.PRESUMED_DEAD)]
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
        decision = decide(owner, evidence)
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
        return "waiting"
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
