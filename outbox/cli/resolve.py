"""``outbox resolve``: one resolver pass over the in-doubt batches."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import click

from outbox.cli.common import (
    known_errors,
    lock_timeout_option,
    server_options,
    settings_from,
    target_source,
    targets_options,
    tuning_options,
)
from outbox.config import Settings
from outbox.events import configure

if TYPE_CHECKING:
    from outbox.fleet.targets import TargetSource
    from resolver import Resolution


@click.command()
@server_options
@tuning_options
@lock_timeout_option
@targets_options
@click.option(
    "--dry-run", is_flag=True, help="Show each decision and its evidence; change nothing."
)
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@known_errors
def resolve(
    dry_run: bool,
    as_json: bool,
    targets: str | None,
    discover: str | None,
    databases: str,
    log_level: str,
    log_format: str,
    **options: Any,
) -> None:
    """Resolve in-doubt batches of dead relays once (relays also do this by themselves).

    With --targets or --discover: in every database of the fleet, each reported on its
    own; one that fails does not stop the others (exit 1 if any failed)."""
    from resolver import run_pass

    configure(log_level, log_format)
    settings = settings_from(**options)
    source = target_source(targets, discover, databases, settings)
    if source is not None:
        resolve_fleet(source, settings, dry_run=dry_run, as_json=as_json)
        return
    results = run_pass(settings, dry_run=dry_run)
    if as_json:
        click.echo(
            json.dumps({"dry_run": dry_run, "batches": [r.as_dict() for r in results]}, indent=2)
        )
        return
    if not results:
        click.echo("no prepared transactions in this cluster")
    for r in results:
        click.echo(describe(r))


def describe(r: Resolution) -> str:
    """One batch's decision, evidence and outcome, as a line."""
    evidence = {True: "in ledger", False: "not in ledger", None: "-"}[r.evidence]
    return (
        f"{r.gid}  age={r.age_seconds:.0f}s  owner={r.decision.owner.value}  "
        f"evidence={evidence}  action={r.decision.action.value}  "
        f"outcome={r.outcome}  ({r.decision.why})"
    )


def resolve_fleet(
    source: TargetSource, settings: Settings, *, dry_run: bool, as_json: bool
) -> None:
    """One pass in each database of the fleet, reported per database."""
    from outbox.ops import fleet

    outcomes = fleet.resolve(fleet.current_targets(source), settings, dry_run=dry_run)
    if as_json:
        click.echo(json.dumps(fleet.resolve_report(outcomes, dry_run=dry_run), indent=2))
    else:
        if not outcomes:
            click.echo("no database to resolve in: the targets list none")
        for o in outcomes:
            if o.failed:
                hint = f" (hint: {o.hint})" if o.hint else ""
                click.echo(f"{o.database}: failed: {o.error}{hint}")
                continue
            mine, foreign = fleet.own_batches(o)
            skipped = f" ({foreign} other prepared transactions never touched)" if foreign else ""
            if not mine:
                click.echo(f"{o.database}: no prepared batch of this outbox{skipped}")
            for r in mine:
                click.echo(f"{o.database}: {describe(r)}")
        failed = sum(1 for o in outcomes if o.failed)
        done = len(outcomes) - failed
        click.echo(f"{len(outcomes)} databases: {done} done, {failed} failed")
    code = fleet.exit_code(outcomes)
    if code:
        sys.exit(code)
