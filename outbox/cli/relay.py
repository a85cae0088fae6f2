"""``outbox relay``: the daemon (its life is ``Relay.serve``'s: ``outbox.lifecycle``)."""

from __future__ import annotations

from typing import Any

import click

from outbox.cli.common import (
    known_errors,
    metrics_address_option,
    metrics_port_option,
    server_options,
    settings_from,
    target_source,
    targets_options,
    tuning_options,
)
from outbox.cli.options import limited
from outbox.events import configure

# A fleet's default --dormant-after (``outbox.fleet.process.DORMANT_AFTER``; the CLI
# does not import the fleet unless it runs one).
DORMANT_AFTER = 30.0


@click.command()
@server_options
@tuning_options
@targets_options
@click.option(
    "--dormant-after",
    envvar="OUTBOX_DORMANT_AFTER",
    show_envvar=True,
    default=None,
    type=limited("dormant_after"),
    help="Seconds with nothing to claim after which a relay keeps only its wake-up "
    "session until woken (0: never).  [default: 0; 30 with --targets/--discover]",
)
@click.option(
    "--drain",
    is_flag=True,
    help="Exit 0 once no claimable row is left (with --targets/--discover: in every database).",
)
@metrics_port_option
@metrics_address_option
@known_errors
def relay(
    targets: str | None,
    discover: str | None,
    databases: str,
    dormant_after: float | None,
    drain: bool,
    metrics_port: int,
    metrics_address: str,
    log_level: str,
    log_format: str,
    **options: Any,
) -> None:
    """Publish committed outbox rows to RabbitMQ until SIGTERM/SIGINT."""
    from outbox.relay.process import Relay, StopFlag

    configure(log_level, log_format)
    fleet = targets is not None or discover is not None
    if dormant_after is None:
        dormant_after = DORMANT_AFTER if fleet else 0.0
    settings = settings_from(dormant_after=dormant_after, **options)
    stop = StopFlag()
    stop.install_signal_handlers()
    source = target_source(targets, discover, databases, settings)
    if source is not None:
        from outbox.fleet.process import Fleet
        from outbox.fleet.serving import serve

        stats = serve(
            Fleet(source, settings, stop=stop, drain=drain),
            metrics_port=metrics_port,
            metrics_address=metrics_address,
        )
    else:
        stats = Relay(settings, stop=stop).serve(
            drain=drain, metrics_port=metrics_port, metrics_address=metrics_address
        )
    if log_format != "json":  # the relay.stopped event, logged, has it all for JSON
        click.echo(
            f"relay stopped: {stats.messages_published} published, "
            f"{stats.batches_committed} batches committed, {stats.dead_letters} dead letters",
            err=True,
        )
