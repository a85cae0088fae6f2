"""``outbox status`` and ``outbox resolve`` over a fleet's databases
(``--targets FILE`` or ``--discover DSN``): the single-database command run for each
target, a few at a time, each with its own bounded session.

A database that is down, refuses (wrong password, no such database, prepared
transactions disabled, no outbox table) or times out is reported in its own entry,
with the reason and hint its single-database command would print, and never stops
the others.  The time a command takes is bounded: each target's session has the
command's ``--connect-timeout`` / ``--statement-timeout`` (and a client deadline),
and ``AT_ONCE`` targets are looked at together, so fifty databases of which a few
hang cost a few of those bounds, not fifty.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from outbox.config import Settings
from outbox.db.session import DSN_OPTION
from outbox.errors import ExitCode, OutboxError
from outbox.fleet.targets import Target, TargetSource
from outbox.ops import status
from outbox.redaction import redact
from resolver.decide import Owner

if TYPE_CHECKING:
    from resolver import Resolution

# How many databases a fleet command looks at together (threads, each one session).
AT_ONCE = 8

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one command found in one database: its ``result``, or why it could not."""

    database: str  # the target's name: the ``database`` label of the relays' metrics
    result: Any = None
    error: str | None = None
    hint: str | None = None
    exit_code: int = int(ExitCode.OK)

    @property
    def failed(self) -> bool:
        return self.error is not None


def current_targets(source: TargetSource) -> list[Target]:
    """The targets the source lists now (a file read, or a discovery pass); raises
    ``OutboxError`` if the file cannot be read or the server cannot be listed."""
    source.poll()
    return list(source.current)


def each(
    targets: Sequence[Target],
    settings: Settings,
    work: Callable[[Settings], T],
    *,
    at_once: int = AT_ONCE,
) -> list[Outcome]:
    """``work`` run with ``settings`` pointed at each target, ``at_once`` together;
    one outcome per target, in the targets' order.  A known error (``OutboxError``)
    becomes its target's outcome; so does any other exception, so that one database
    never stops the others."""

    def one(target: Target) -> Outcome:
        try:
            return Outcome(target.name, work(dataclasses.replace(settings, dsn=target.dsn)))
        except OutboxError as exc:
            # The DSN is the target's, not --dsn's: say where it comes from.
            hint = exc.hint.replace(DSN_OPTION, "its DSN in the targets") if exc.hint else None
            return Outcome(target.name, error=exc.message, hint=hint, exit_code=int(exc.exit_code))
        except Exception as exc:  # a bug must not hide the other databases' figures
            return Outcome(
                target.name,
                error=redact(f"unexpected {type(exc).__name__}: {exc}"),
                exit_code=int(ExitCode.FAILURE),
            )

    if not targets:
        return []
    with concurrent.futures.ThreadPoolExecutor(
        max_workers=max(1, min(at_once, len(targets))), thread_name_prefix="outbox-fleet"
    ) as pool:
        return list(pool.map(one, targets))


# -- status -------------------------------------------------------------------------
# A database that cannot be read, in a word, by the exit code its own command has.
FAILED_AS = {
    int(ExitCode.UNREACHABLE): "unreachable",
    int(ExitCode.NOT_READY): "not ready",
    int(ExitCode.SCHEMA_TOO_NEW): "schema too new",
    int(ExitCode.TIMED_OUT): "timed out",
}
# The figures of each database a fleet's status line shows, summed in its summary.
SUMMED = ("backlog_rows", "prepared", "dead_letters", "scheduled_rows")


def collect(
    targets: Sequence[Target],
    settings: Settings,
    *,
    exact: bool = False,
    max_prepared_age: float,
    max_backlog_age: float = 300.0,
    max_horizon_age: float = 600.0,
    at_once: int = AT_ONCE,
) -> dict[str, Any]:
    """``outbox status --json`` of every target, and a summary (what a fleet's
    ``status`` prints).  ``attention`` lists every database's problems, each named
    with its database, and one line for each database that could not be read."""

    def one(target_settings: Settings) -> dict[str, Any]:
        return status.collect(
            target_settings,
            exact=exact,
            max_prepared_age=max_prepared_age,
            max_backlog_age=max_backlog_age,
            max_horizon_age=max_horizon_age,
        )

    outcomes = each(targets, settings, one, at_once=at_once)
    databases = [database_entry(o) for o in outcomes]
    attention = []
    for entry in databases:
        if entry["error"] is not None:
            hint = f" ({entry['hint']})" if entry["hint"] else ""
            attention.append(f"{entry['database']}: cannot be read: {entry['error']}{hint}")
        else:
            attention += [f"{entry['database']}: {p}" for p in entry["status"]["attention"]]
    if not databases:
        attention.append(
            "no database to look at: the targets file lists none, or discovery found "
            "none with the outbox table"
        )
    return {
        "table": settings.table,
        "databases": databases,
        "summary": summary(databases),
        "attention": attention,
    }


def database_entry(outcome: Outcome) -> dict[str, Any]:
    """One database of a fleet's status: its figures (``status`` is the whole
    single-database report), or the error that kept it from being read."""
    entry: dict[str, Any] = {
        "database": outcome.database,
        "state": "error" if outcome.failed else "ok",
        # What kept it from being read, in a word (its exit code's meaning).
        "why": FAILED_AS.get(outcome.exit_code, "failed") if outcome.failed else None,
        "error": outcome.error,
        "hint": outcome.hint,
        "exit_code": outcome.exit_code,  # what its own ``outbox status`` would exit with
        "status": outcome.result,
    }
    report = outcome.result
    if report is not None:
        entry.update(
            state="attention" if report["attention"] else "ok",
            backlog_rows=report["backlog_rows"],
            oldest_row_age_seconds=report["oldest_row_age_seconds"],
            prepared=len(report["prepared_batches"]),
            oldest_prepared_age_seconds=report["oldest_prepared_age_seconds"],
            dead_letters=report["dead_letters"],
            live_relays=report["live_relays"],
            scheduled_rows=report["scheduled_rows"],
        )
    return entry


def summary(databases: Sequence[dict[str, Any]]) -> dict[str, Any]:
    read = [d for d in databases if d["status"] is not None]
    states = [d["state"] for d in databases]
    return {
        "databases": len(databases),
        "ok": states.count("ok"),
        "attention": states.count("attention"),
        "error": states.count("error"),
        **{name: sum(int(d[name]) for d in read) for name in SUMMED},
        "oldest_row_age_seconds": max((d["oldest_row_age_seconds"] for d in read), default=0.0),
        "oldest_prepared_age_seconds": max(
            (d["oldest_prepared_age_seconds"] for d in read), default=0.0
        ),
        "without_relay": sum(1 for d in read if not d["live_relays"]),
    }


COLUMNS = (
    ("database", 24),
    ("backlog", 9),
    ("oldest", 8),
    ("in doubt", 9),
    ("oldest", 8),
    ("dead", 6),
    ("relays", 7),
    ("scheduled", 10),
)


def render(report: dict[str, Any]) -> str:
    """A fleet's status for a terminal: one line per database, its problems under
    it, and a summary line."""
    header = "".join(name.ljust(width) for name, width in COLUMNS) + "state"
    lines = [header]
    for d in report["databases"]:
        name = d["database"] if len(d["database"]) < 24 else d["database"][:22] + "…"
        if d["status"] is None:
            lines.append(f"{name.ljust(24)}{d['why']}: {d['error']}")
            if d["hint"]:
                lines.append(f"{'':24}  hint: {d['hint']}")
            continue
        cells = (
            name,
            f"{d['backlog_rows']:,}",
            f"{d['oldest_row_age_seconds']:.1f}s",
            str(d["prepared"]),
            f"{d['oldest_prepared_age_seconds']:.1f}s",
            str(d["dead_letters"]),
            str(d["live_relays"]),
            str(d["scheduled_rows"]),
        )
        state = "needs attention" if d["state"] == "attention" else "ok"
        lines.append(
            "".join(c.ljust(w - 1) + " " for c, (_, w) in zip(cells, COLUMNS, strict=True)) + state
        )
        lines.extend(f"{'':24}- {problem}" for problem in d["status"]["attention"])
        lines.extend(f"{'':24}warning: {w}" for w in d["status"]["warnings"])
    lines.append(render_summary(report))
    return "\n".join(lines)


def render_summary(report: dict[str, Any]) -> str:
    s = report["summary"]
    if not s["databases"]:
        return f"needs attention: {report['attention'][0]}"
    return (
        f"{s['databases']} database{'' if s['databases'] == 1 else 's'}: {s['ok']} all good, "
        f"{s['attention']} need attention, {s['error']} cannot be read; "
        f"backlog {s['backlog_rows']:,} rows "
        f"(oldest {s['oldest_row_age_seconds']:.1f}s), {s['prepared']} prepared batches "
        f"(oldest {s['oldest_prepared_age_seconds']:.1f}s), {s['dead_letters']} dead letters, "
        f"{s['without_relay']} without a live relay"
    )


# -- resolve ------------------------------------------------------------------------
def resolve(
    targets: Sequence[Target], settings: Settings, *, dry_run: bool, at_once: int = AT_ONCE
) -> list[Outcome]:
    """One resolver pass in each target (``outbox resolve``); each outcome's
    ``result`` is the list of ``resolver.Resolution``."""
    from resolver import run_pass

    return each(targets, settings, lambda s: run_pass(s, dry_run=dry_run), at_once=at_once)


def own_batches(outcome: Outcome) -> tuple[list[Resolution], int]:
    """A database's resolutions of this outbox's batches, and how many other prepared
    transactions it skipped.  ``pg_prepared_xacts`` lists the whole cluster's, so each
    database of a server would otherwise list every other's batches (as foreign)."""
    mine = [r for r in outcome.result or () if r.decision.owner is not Owner.FOREIGN]
    return mine, len(outcome.result or ()) - len(mine)


def resolve_report(outcomes: Sequence[Outcome], *, dry_run: bool) -> dict[str, Any]:
    """The JSON document of a fleet's ``outbox resolve --json``."""
    return {
        "dry_run": dry_run,
        "databases": [
            {
                "database": o.database,
                "error": o.error,
                "hint": o.hint,
                "exit_code": o.exit_code,
                "batches": None if o.failed else [r.as_dict() for r in own_batches(o)[0]],
                "foreign_skipped": None if o.failed else own_batches(o)[1],
            }
            for o in outcomes
        ],
        "failed": [o.database for o in outcomes if o.failed],
    }


def exit_code(outcomes: Sequence[Outcome]) -> int:
    """A fleet command's exit code: 0 if it was done in every database, else 1 (each
    failed database's entry says why, with the code its own command would exit)."""
    return int(ExitCode.FAILURE if any(o.failed for o in outcomes) else ExitCode.OK)
