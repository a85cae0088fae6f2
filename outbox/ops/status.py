"""``outbox status``: what an operator needs to know, for humans and scripts.

``read`` runs the queries and returns plain data (``Observation``); ``judge``
decides, purely, what needs attention; ``report`` and ``render`` present it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from outbox.config import Settings
from outbox.db import migrate, privileges, replication
from outbox.db.batches import BatchStore
from resolver.decide import is_ours


@dataclasses.dataclass(frozen=True)
class Observation:
    """What ``outbox status`` reads, as plain data (``read``); ``judge`` decides."""

    table: str
    schema_version: int | None
    backlog_rows: int
    oldest_row_age_seconds: float
    prepared_batches: list[dict[str, Any]]
    foreign_prepared_transactions: list[dict[str, Any]]
    relays: list[dict[str, Any]]
    dead_letters: int
    dead_letter_ordering_keys: int
    replication_warning: str | None

    @property
    def oldest_prepared_age_seconds(self) -> float:
        return max((float(b["age_seconds"]) for b in self.prepared_batches), default=0.0)

    @property
    def live_relays(self) -> int:
        return sum(1 for r in self.relays if r["alive"])


def read(settings: Settings) -> Observation:
    """Every query ``status`` needs, on one short session; no judgement here."""
    store = BatchStore(settings.dsn, settings.table, application_name="outbox-status")
    try:
        store.check_privileges(privileges.STATUS, "outbox status")
        version = migrate.current_version(store.conn, settings.table)
        if version is None:
            store.check_ready()  # raises SchemaNotReady with the hint
        migrate.refuse_newer(version, settings.table)
        backlog = store.backlog()
        ours: list[dict[str, Any]] = []
        foreign: list[dict[str, Any]] = []
        for batch in store.prepared_batches():
            entry = {
                "gid": batch.gid,
                "age_seconds": round(batch.age_seconds, 3),
                "owner": batch.owner,
                "prepared": batch.prepared.isoformat(),
            }
            mine = is_ours(batch.gid, local=batch.local, table=settings.table)
            (ours if mine else foreign).append(entry)
        relays = [
            {
                "relay_id": r["relay_id"],
                "hostname": r["hostname"],
                "pid": r["pid"],
                "started_at": r["started_at"].isoformat(),
                "heartbeat_age_seconds": round(r["heartbeat_age"], 3),
                "alive": r["alive"],
            }
            for r in store.live_relays()
        ]
        dead_letters, dead_keys = store.dead_letter_summary()
        unsafe = replication.warning(store.replication())
    finally:
        store.close()
    return Observation(
        table=settings.table,
        schema_version=version,
        backlog_rows=backlog["rows"],
        oldest_row_age_seconds=round(backlog["oldest_age_seconds"], 3),
        prepared_batches=ours,
        foreign_prepared_transactions=foreign,
        relays=relays,
        dead_letters=dead_letters,
        dead_letter_ordering_keys=dead_keys,
        replication_warning=unsafe,
    )


def judge(seen: Observation, *, max_prepared_age: float, max_backlog_age: float) -> list[str]:
    """What needs an operator's attention, each with what to do (pure)."""
    problems = []
    oldest_prepared = seen.oldest_prepared_age_seconds
    if oldest_prepared > max_prepared_age:
        problems.append(
            f"a prepared batch is {oldest_prepared:.0f}s old (> {max_prepared_age:.0f}s): "
            "run `outbox resolve --dry-run` (docs/how-to/resolving.md)"
        )
    if seen.dead_letters:
        problems.append(f"{seen.dead_letters} dead letters: see `outbox dead-letters list`")
    if seen.dead_letter_ordering_keys:
        problems.append(
            f"{seen.dead_letter_ordering_keys} ordering keys have dead letters, which hold "
            "their later messages back (unless relays run with --ordering-dead-letters "
            "skip): after the fix, `outbox dead-letters retry --ordering-key KEY`"
        )
    if seen.oldest_row_age_seconds > max_backlog_age:
        # A young backlog with no relay is normal for a moment (a restart, a deploy).
        why = (
            "relays are behind or failing, see their logs"
            if seen.live_relays
            else "no relay is running"
        )
        problems.append(
            f"the oldest outbox row is {seen.oldest_row_age_seconds:.0f}s old "
            f"(> {max_backlog_age:.0f}s): {why}"
        )
    return problems


def report(seen: Observation, problems: list[str]) -> dict[str, Any]:
    """The JSON document of ``outbox status --json`` (and what ``render`` prints)."""
    return {
        "table": seen.table,
        "schema_version": seen.schema_version,
        "backlog_rows": seen.backlog_rows,
        "oldest_row_age_seconds": seen.oldest_row_age_seconds,
        "prepared_batches": seen.prepared_batches,
        "oldest_prepared_age_seconds": round(seen.oldest_prepared_age_seconds, 3),
        "foreign_prepared_transactions": seen.foreign_prepared_transactions,
        "relays": seen.relays,
        "live_relays": seen.live_relays,
        "dead_letters": seen.dead_letters,
        "dead_letter_ordering_keys": seen.dead_letter_ordering_keys,
        "attention": problems,
        # Worth knowing, not a failure of the relay: does not change the exit code.
        "warnings": [seen.replication_warning] if seen.replication_warning else [],
    }


def collect(
    settings: Settings, *, max_prepared_age: float, max_backlog_age: float = 300.0
) -> dict[str, Any]:
    """Read, judge, report: what ``outbox status`` prints."""
    seen = read(settings)
    problems = judge(seen, max_prepared_age=max_prepared_age, max_backlog_age=max_backlog_age)
    return report(seen, problems)


def render(report: dict[str, Any]) -> str:
    lines = [
        f"outbox table       {report['table']} (schema version {report['schema_version']})",
        f"backlog            {report['backlog_rows']} rows, oldest "
        f"{report['oldest_row_age_seconds']:.1f}s",
        f"prepared batches   {len(report['prepared_batches'])}, oldest "
        f"{report['oldest_prepared_age_seconds']:.1f}s",
        f"foreign prepared   {len(report['foreign_prepared_transactions'])} (never touched)",
        f"live relays        {report['live_relays']}",
        f"dead letters       {report['dead_letters']}"
        + (
            f" ({report['dead_letter_ordering_keys']} ordering keys)"
            if report["dead_letter_ordering_keys"]
            else ""
        ),
    ]
    for relay in report["relays"]:
        state = "alive" if relay["alive"] else "gone"
        lines.append(
            f"  relay {relay['relay_id'][:12]} {relay['hostname']}:{relay['pid']} "
            f"{state}, heartbeat {relay['heartbeat_age_seconds']:.1f}s ago"
        )
    for batch in report["prepared_batches"]:
        lines.append(f"  batch {batch['gid']} prepared {batch['age_seconds']:.1f}s ago")
    lines.extend(f"warning: {warning}" for warning in report["warnings"])
    if report["attention"]:
        lines.append("needs attention:")
        lines.extend(f"  - {problem}" for problem in report["attention"])
    else:
        lines.append("all good")
    return "\n".join(lines)
