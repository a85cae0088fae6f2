"""``outbox status``: what an operator needs to know."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from outbox.cli.common import (
    connect_timeout_option,
    env_option,
    known_errors,
    operator_session_options,
    server_options,
    settings_from,
    target_source,
    targets_options,
)
from outbox.cli.options import (
    FiniteFloatRange,
)
from outbox.errors import ExitCode


@click.command()
@server_options
@operator_session_options
@connect_timeout_option
@targets_options
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.option(
    "--exact",
    is_flag=True,
    help="Count the backlog by reading every row of the outbox (slow behind a held "
    "MVCC horizon): also rows the relays' claim front cannot see.",
)
@click.option(
    "--max-prepared-age",
    envvar="OUTBOX_MAX_PREPARED_AGE",
    show_envvar=True,
    default=60.0,
    show_default=True,
    type=FiniteFloatRange(0, 365 * 86400),
    help="A prepared batch older than this (s) needs attention (exit 1).",
)
@env_option(
    "--max-backlog-age",
    "OUTBOX_MAX_BACKLOG_AGE",
    default=300.0,
    type=FiniteFloatRange(0, 365 * 86400),
    help="An outbox row older than this (s) needs attention (exit 1).",
)
@env_option(
    "--max-horizon-age",
    "OUTBOX_MAX_HORIZON_AGE",
    default=600.0,
    type=FiniteFloatRange(0, 365 * 86400),
    help="A session or prepared transaction holding the outbox's dead rows (the MVCC "
    "horizon) for longer than this (s) needs attention (exit 1).",
)
@known_errors
def status(
    as_json: bool,
    exact: bool,
    max_prepared_age: float,
    max_backlog_age: float,
    max_horizon_age: float,
    targets: str | None,
    discover: str | None,
    databases: str,
    log_level: str,
    log_format: str,
    **options: Any,
) -> None:
    """Backlog, prepared batches, live relays, dead letters and what holds the MVCC
    horizon; exit 1 if attention needed.

    With --targets or --discover: every database of the fleet, a line each and a
    summary; exit 1 if any database needs attention or cannot be read."""
    from outbox.ops.status import collect, render

    settings = settings_from(**options)
    source = target_source(targets, discover, databases, settings)
    if source is not None:
        from outbox.ops import fleet

        report = fleet.collect(
            fleet.current_targets(source),
            settings,
            exact=exact,
            max_prepared_age=max_prepared_age,
            max_backlog_age=max_backlog_age,
            max_horizon_age=max_horizon_age,
        )
        click.echo(json.dumps(report, indent=2, default=str) if as_json else fleet.render(report))
        if report["attention"]:
            sys.exit(int(ExitCode.FAILURE))
        return
    report = collect(
        settings,
        exact=exact,
        max_prepared_age=max_prepared_age,
        max_backlog_age=max_backlog_age,
        max_horizon_age=max_horizon_age,
    )
    click.echo(json.dumps(report, indent=2, default=str) if as_json else render(report))
    if report["attention"]:
        sys.exit(int(ExitCode.FAILURE))
