"""``outbox status``: what an operator needs to know, for humans and scripts."""

from __future__ import annotations

from typing import Any

from outbox import gid as gids
from outbox.config import Settings
from outbox.db import migrate, privileges, replication
from outbox.db.batches import BatchStore


def collect(
    settings: Settings, *, max_prepared_age: float, max_backlog_age: float = 300.0
) -> dict[str, Any]:
    store = BatchStore(settings.dsn, settings.table, application_name="outbox-status")
    try:
        store.check_privileges(privileges.STATUS, "outbox status")
        version = migrate.current_version(store.conn, settings.table)
        if version is None:
            store.check_ready()  # raises SchemaNotReady with the hint
        migrate.refuse_newer(version, settings.table)
        backlog = store.backlog()
        prepared = store.prepared_batches()
        ours: list[dict[str, Any]] = []
        foreign: list[dict[str, Any]] = []
        for batch in prepared:
            parsed = gids.parse(batch.gid)
            entry = {
                "gid": batch.gid,
                "age_seconds": round(batch.age_seconds, 3),
                "owner": batch.owner,
                "prepared": batch.prepared.isoformat(),
            }
            if batch.local and parsed is not None and parsed.table == settings.table:
                ours.append(entry)
            else:
                foreign.append(entry)
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
    oldest_prepared = max((float(b["age_seconds"]) for b in ours), default=0.0)
    problems = []
    if oldest_prepared > max_prepared_age:
        problems.append(
            f"a prepared batch is {oldest_prepared:.0f}s old (> {max_prepared_age:.0f}s): "
            "run `outbox resolve --dry-run` (README: a stuck prepared transaction)"
        )
    if dead_letters:
        problems.append(f"{dead_letters} dead letters: see `outbox dead-letters list`")
    if dead_keys:
        problems.append(
            f"{dead_keys} ordering keys have dead letters, which hold their later messages "
            "back (unless relays run with --ordering-dead-letters skip): after the fix, "
            "`outbox dead-letters retry --ordering-key KEY`"
        )
    live = sum(1 for r in relays if r["alive"])
    if backlog["oldest_age_seconds"] > max_backlog_age:
        # A young backlog with no relay is normal for a moment (a restart, a deploy).
        why = "relays are behind or failing, see their logs" if live else "no relay is running"
        problems.append(
            f"the oldest outbox row is {backlog['oldest_age_seconds']:.0f}s old "
            f"(> {max_backlog_age:.0f}s): {why}"
        )
    return {
        "table": settings.table,
        "schema_version": version,
        "backlog_rows": backlog["rows"],
        "oldest_row_age_seconds": round(backlog["oldest_age_seconds"], 3),
        "prepared_batches": ours,
        "oldest_prepared_age_seconds": round(oldest_prepared, 3),
        "foreign_prepared_transactions": foreign,
        "relays": relays,
        "live_relays": live,
        "dead_letters": dead_letters,
        "dead_letter_ordering_keys": dead_keys,
        "attention": problems,
        # Worth knowing, not a failure of the relay: does not change the exit code.
        "warnings": [unsafe] if unsafe else [],
    }


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
