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
    tuning_options,
)
from outbox.events import configure


@click.command()
@server_options
@tuning_options
@click.option("--drain", is_flag=True, help="Exit 0 once no claimable row is left.")
@metrics_port_option
@metrics_address_option
@known_errors
def relay(
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
    settings = settings_from(**options)
    stop = StopFlag()
    stop.install_signal_handlers()
    stats = Relay(settings, stop=stop).serve(
        drain=drain, metrics_port=metrics_port, metrics_address=metrics_address
    )
    if log_format != "json":  # the relay.stopped event, logged, has it all for JSON
        click.echo(
            f"relay stopped: {stats.messages_published} published, "
            f"{stats.batches_committed} batches committed, {stats.dead_letters} dead letters",
            err=True,
        )
