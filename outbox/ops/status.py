"""``outbox status``: what an operator needs to know, for humans and scripts.

``read`` runs the queries and returns plain data (``Observation``); ``judge``
decides, purely, what needs attention; ``report`` and ``render`` present it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from outbox.config import Settings
from outbox.db import migrate, privileges, replication
from outbox.db.batches import PREPARED_DISABLED, PREPARED_DISABLED_HINT
from outbox.db.horizon import Holder, Horizon, HorizonReader
from outbox.terminal import shown
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
    horizon: Horizon | None = None
    # The backlog counted by reading every row (``--exact``), or where the claims look.
    backlog_exact: bool = False
    # The safety net (``outbox.db.front.NetState``): how long ago its last full pass
    # began and how many rows it found that the cheap count could not see (None: no
    # full pass yet).
    last_full_pass_age_seconds: float | None = None
    last_full_pass_found_rows: int | None = None
    # Rows scheduled for later (schema 0009), seconds until the next is due (None:
    # none), and how long the oldest due row has waited to be moved.
    scheduled_rows: int = 0
    next_due_seconds: float | None = None
    scheduled_overdue_seconds: float = 0.0
    # The server's max_prepared_transactions (0: no relay can work here; None: not read).
    prepared_slots: int | None = None

    @property
    def oldest_prepared_age_seconds(self) -> float:
        return max((float(b["age_seconds"]) for b in self.prepared_batches), default=0.0)

    @property
    def live_relays(self) -> int:
        return sum(1 for r in self.relays if r["alive"])


def open_reader(settings: Settings, application_name: str = "outbox-status") -> HorizonReader:
    """A session for what ``status`` reads (the backlog from the relays' saved front,
    batches, relays, the horizon), bounded by the settings' timeouts; the console's
    charts sample through one too (``BatchStore.chart_sample``)."""
    return HorizonReader(
        settings.dsn,
        settings.table,
        application_name=application_name,
        connect_timeout=settings.connect_timeout,
        statement_timeout=settings.statement_timeout,
        lock_timeout=settings.lock_timeout,
        client_deadline=True,
    )


def read(settings: Settings, *, exact: bool = False) -> Observation:
    """Every query ``status`` needs, on one short session; no judgement here.
    ``exact``: count the backlog by reading every row of the outbox."""
    store = open_reader(settings)
    try:
        store.check_privileges(privileges.STATUS, "outbox status")
        version = migrate.version_of(store)
        if version is None:
            store.check_ready()  # raises SchemaNotReady with the hint
        migrate.refuse_newer(version, settings.table)
        if exact:
            backlog = store.exact_backlog()
            store.saved_front()  # the safety net's record, read with the front
        else:
            backlog = store.backlog()
        net = store.net
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
        scheduled = store.scheduled_summary()
        unsafe = replication.warning(store.replication())
        horizon = store.horizon()
        slots = store.prepared_slots()
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
        horizon=horizon,
        backlog_exact=exact,
        last_full_pass_age_seconds=None
        if net.last_pass_age is None
        else round(net.last_pass_age, 3),
        last_full_pass_found_rows=net.last_pass_found,
        scheduled_rows=scheduled["scheduled_rows"],
        next_due_seconds=None
        if scheduled["next_due_seconds"] is None
        else round(scheduled["next_due_seconds"], 3),
        scheduled_overdue_seconds=round(scheduled["overdue_seconds"], 3),
        prepared_slots=slots,
    )


# A replication slot's age is known in transactions only: this many is attention.
SLOT_XMIN_ATTENTION_XIDS = 1_000_000


def judge(
    seen: Observation,
    *,
    max_prepared_age: float,
    max_backlog_age: float,
    max_horizon_age: float = 600.0,
) -> list[str]:
    """What needs an operator's attention, each with what to do (pure)."""
    problems = []
    if seen.prepared_slots == 0:
        problems.append(f"{PREPARED_DISABLED}: no relay can work here; {PREPARED_DISABLED_HINT}")
    if seen.horizon is not None:
        problems += judge_horizon(seen.horizon, seen.table, max_horizon_age)
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
    if seen.scheduled_overdue_seconds > max_backlog_age:
        why = "relays are behind or failing" if seen.live_relays else "no relay is running"
        problems.append(
            f"a scheduled row has been due for {seen.scheduled_overdue_seconds:.0f}s "
            f"(> {max_backlog_age:.0f}s) and is not in the outbox yet: {why} "
            "(relays move due rows; docs/how-to/deliver-later.md)"
        )
    return problems


def judge_horizon(horizon: Horizon, table: str, max_age: float) -> list[str]:
    """A holder of the outbox's dead rows older than ``max_age`` seconds (or a slot
    more than ``SLOT_XMIN_ATTENTION_XIDS`` behind), named with what to do (pure)."""
    late = [
        h
        for h in horizon.holders
        if h.holds_outbox
        and (
            (h.age_seconds is not None and h.age_seconds > max_age)
            or (h.kind == "replication_slot" and h.xmin_age_xids > SLOT_XMIN_ATTENTION_XIDS)
        )
    ]
    if not late:
        return []
    dead = f"{horizon.dead_rows:,}" if horizon.dead_rows is not None else "an unknown number of"
    oldest = late[0]
    return [
        f"{describe_holder(oldest, table)} holds the MVCC horizon back "
        f"({holder_age(oldest)}): vacuum cannot remove the outbox's {dead} dead rows, "
        f"and the table grows; {what_to_do(oldest, table)} "
        "(docs/how-to/operations.md#a-held-horizon)"
    ]


def describe_holder(holder: Holder, table: str) -> str:
    d = holder.detail
    if holder.kind == "session":
        app = shown(d.get("application_name") or "no application_name")
        state = d.get("state") or d["backend_type"]
        return f"session pid {d['pid']} ({app}, role {d.get('role')}, {state})"
    if holder.kind == "replication_slot":
        active = "active" if d.get("active") else "inactive"
        return f"replication slot {holder.name!r} ({d.get('slot_type')}, {active})"
    mine = is_ours(holder.name, local=True, table=table)
    return f"prepared transaction {holder.name!r} ({'a relay batch' if mine else 'not ours'})"


def holder_age(holder: Holder) -> str:
    when = f"{holder.age_seconds:.0f}s, " if holder.age_seconds is not None else ""
    return f"{when}{holder.xmin_age_xids:,} transactions"


def what_to_do(holder: Holder, table: str) -> str:
    if holder.kind == "session":
        pid = holder.detail["pid"]
        return (
            "end its transaction if its owner agrees, or "
            f"`SELECT pg_terminate_backend({pid})`; set idle_in_transaction_session_timeout"
        )
    if holder.kind == "replication_slot":
        return (
            "bring its standby or consumer back, or drop it if it is abandoned "
            f"(`SELECT pg_drop_replication_slot('{holder.name}')`)"
        )
    if is_ours(holder.name, local=True, table=table):
        return "run `outbox resolve --dry-run`"
    return "its owner must COMMIT PREPARED or ROLLBACK PREPARED it (outbox never touches it)"


def report(seen: Observation, problems: list[str]) -> dict[str, Any]:
    """The JSON document of ``outbox status --json`` (and what ``render`` prints)."""
    return {
        "table": seen.table,
        "schema_version": seen.schema_version,
        "backlog_rows": seen.backlog_rows,
        "oldest_row_age_seconds": seen.oldest_row_age_seconds,
        # "exact": every row read (--exact); "claim front": counted where the relays'
        # claims look, which misses a row behind the front whose txid is not its
        # writer's until a full pass of the safety net finds it.
        "backlog_counted": "exact" if seen.backlog_exact else "claim front",
        "last_full_pass_age_seconds": seen.last_full_pass_age_seconds,
        "last_full_pass_found_rows": seen.last_full_pass_found_rows,
        "prepared_batches": seen.prepared_batches,
        "oldest_prepared_age_seconds": round(seen.oldest_prepared_age_seconds, 3),
        "foreign_prepared_transactions": seen.foreign_prepared_transactions,
        "relays": seen.relays,
        "live_relays": seen.live_relays,
        "dead_letters": seen.dead_letters,
        "dead_letter_ordering_keys": seen.dead_letter_ordering_keys,
        "scheduled_rows": seen.scheduled_rows,
        "next_due_seconds": seen.next_due_seconds,
        "scheduled_overdue_seconds": seen.scheduled_overdue_seconds,
        "prepared_slots": seen.prepared_slots,
        "horizon": horizon_report(seen.horizon),
        "attention": problems,
        # Worth knowing, not a failure of the relay: does not change the exit code.
        "warnings": [w for w in (seen.replication_warning, found_warning(seen)) if w is not None],
    }


def found_warning(seen: Observation) -> str | None:
    """The last full pass of the safety net found rows that the claims and the cheap
    count could not see: something wrote the outbox with its triggers off."""
    if not seen.last_full_pass_found_rows:
        return None
    return (
        f"the last full pass of the safety net found {seen.last_full_pass_found_rows} "
        f"rows of {seen.table} behind the claim front whose txid was not their writer's "
        "(written with the outbox's triggers off, e.g. pg_restore --disable-triggers); "
        "they wait for a pass and may follow later rows of their ordering key: "
        "reload rows with INSERT … SELECT, triggers on"
    )


def horizon_report(horizon: Horizon | None) -> dict[str, Any] | None:
    if horizon is None:
        return None
    return {
        "age_xids": horizon.age_xids,
        "age_seconds": round(horizon.age_seconds, 3),
        "dead_rows": horizon.dead_rows,
        "live_rows": horizon.live_rows,
        "table_bytes": horizon.table_bytes,
        "last_vacuum": horizon.last_vacuum.isoformat() if horizon.last_vacuum else None,
        "hidden_sessions": horizon.hidden_sessions,
        "holders": [
            {
                "kind": h.kind,
                "name": h.name,
                "xmin_age_xids": h.xmin_age_xids,
                "age_seconds": None if h.age_seconds is None else round(h.age_seconds, 3),
                "holds_outbox": h.holds_outbox,
                **h.detail,
            }
            for h in horizon.holders
        ],
    }


def collect(
    settings: Settings,
    *,
    exact: bool = False,
    max_prepared_age: float,
    max_backlog_age: float = 300.0,
    max_horizon_age: float = 600.0,
) -> dict[str, Any]:
    """Read, judge, report: what ``outbox status`` prints."""
    seen = read(settings, exact=exact)
    problems = judge(
        seen,
        max_prepared_age=max_prepared_age,
        max_backlog_age=max_backlog_age,
        max_horizon_age=max_horizon_age,
    )
    return report(seen, problems)


def unseen_note(report: dict[str, Any]) -> str:
    """What the cheap count of the backlog cannot know, said beside it."""
    if report["backlog_counted"] == "exact":
        return " (exact: every row read)"
    age = report["last_full_pass_age_seconds"]
    if age is None:
        last = "no full pass of the safety net yet"
    else:
        last = (
            f"last full pass of the safety net {age:.0f}s ago found "
            f"{report['last_full_pass_found_rows']}"
        )
    return (
        f"\n                   not counted: rows behind the claim front whose txid is not "
        f"their writer's ({last}); --exact reads every row"
    )


def render(report: dict[str, Any]) -> str:
    lines = [
        f"outbox table       {report['table']} (schema version {report['schema_version']})",
        f"backlog            {report['backlog_rows']} rows, oldest "
        f"{report['oldest_row_age_seconds']:.1f}s" + unseen_note(report),
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
        f"scheduled          {report.get('scheduled_rows', 0)} rows" + scheduled_note(report),
    ]
    for relay in report["relays"]:
        state = "alive" if relay["alive"] else "gone"
        lines.append(
            f"  relay {relay['relay_id'][:12]} {relay['hostname']}:{relay['pid']} "
            f"{state}, heartbeat {relay['heartbeat_age_seconds']:.1f}s ago"
        )
    for batch in report["prepared_batches"]:
        lines.append(f"  batch {batch['gid']} prepared {batch['age_seconds']:.1f}s ago")
    lines += render_horizon(report.get("horizon"))
    lines.extend(f"warning: {warning}" for warning in report["warnings"])
    if report["attention"]:
        lines.append("needs attention:")
        lines.extend(f"  - {problem}" for problem in report["attention"])
    else:
        lines.append("all good")
    return "\n".join(lines)


def scheduled_note(report: dict[str, Any]) -> str:
    """When the next scheduled row is due, and how late the oldest due one is."""
    parts = []
    if report.get("next_due_seconds") is not None:
        parts.append(f"next due in {report['next_due_seconds']:.1f}s")
    if report.get("scheduled_overdue_seconds"):
        parts.append(f"oldest due {report['scheduled_overdue_seconds']:.1f}s ago, not moved yet")
    return f", {', '.join(parts)}" if parts else ""


def render_horizon(horizon: dict[str, Any] | None) -> list[str]:
    if horizon is None:
        return []
    dead = "no statistics yet" if horizon["dead_rows"] is None else f"{horizon['dead_rows']:,}"
    size = (
        ""
        if horizon["table_bytes"] is None
        else f", table {horizon['table_bytes'] / 1024 / 1024:.1f} MiB with indexes"
    )
    lines = [
        f"horizon            {horizon['age_xids']:,} transactions, "
        f"{horizon['age_seconds']:.1f}s behind",
        f"outbox dead rows   {dead}{size}",
    ]
    for h in horizon["holders"]:
        age = "" if h["age_seconds"] is None else f"{h['age_seconds']:.1f}s, "
        if h["kind"] == "session":
            what = (
                f"session pid {h['pid']} {h['application_name'] or '-'!r} "
                f"{h['state'] or h['backend_type']}"
            )
        elif h["kind"] == "replication_slot":
            active = "active" if h["active"] else "inactive"
            what = f"slot {h['name']!r} ({h['slot_type']}, {active})"
        else:
            what = f"prepared {h['name']!r}"
        scope = "" if h["holds_outbox"] else " (system catalogs only)"
        lines.append(f"  held by {what}: {age}{h['xmin_age_xids']:,} transactions{scope}")
    if horizon["hidden_sessions"]:
        lines.append(
            f"  {horizon['hidden_sessions']} sessions of other roles not shown "
            "(grant pg_read_all_stats to see them)"
        )
    return lines
