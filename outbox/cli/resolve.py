"""``outbox resolve``: one resolver pass over the in-doubt batches."""

from __future__ import annotations

import json
from typing import Any

import click

from outbox.cli.common import (
    known_errors,
    lock_timeout_option,
    server_options,
    settings_from,
    tuning_options,
)
from outbox.events import configure


@click.command()
@server_options
@tuning_options
@lock_timeout_option
@click.option(
    "--dry-run", is_flag=True, help="Show each decision and its evidence; change nothing."
)
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@known_errors
def resolve(dry_run: bool, as_json: bool, log_level: str, log_format: str, **options: Any) -> None:
    """Resolve in-doubt batches of dead relays once (relays also do this by themselves)."""
    from resolver import run_pass

    configure(log_level, log_format)
    results = run_pass(settings_from(**options), dry_run=dry_run)
    if as_json:
        click.echo(
            json.dumps({"dry_run": dry_run, "batches": [r.as_dict() for r in results]}, indent=2)
        )
        return
    if not results:
        click.echo("no prepared transactions in this cluster")
    for r in results:
        evidence = {True: "in ledger", False: "not in ledger", None: "-"}[r.evidence]
        click.echo(
            f"{r.gid}  age={r.age_seconds:.0f}s  owner={r.decision.owner.value}  "
            f"evidence={evidence}  action={r.decision.action.value}  "
            f"outcome={r.outcome}  ({r.decision.why})"
        )
