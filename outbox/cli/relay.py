"""``outbox relay``: the daemon."""

from __future__ import annotations

import logging
from typing import Any

import click

from outbox.cli.common import (
    collect_young_less_often,
    freeze_startup_heap,
    known_errors,
    metrics_address_option,
    metrics_port_option,
    server_options,
    settings_from,
    tuning_options,
)
from outbox.events import configure, emit

log = logging.getLogger("outbox.cli")


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
    from outbox.ops.endpoints import Endpoints
    from outbox.relay.process import Relay, StopFlag

    configure(log_level, log_format)
    settings = settings_from(**options)
    stop = StopFlag()
    stop.install_signal_handlers()
    runner = Relay(settings, stop=stop)
    endpoints = None
    if metrics_port:
        try:
            endpoints = Endpoints(runner, port=metrics_port, address=metrics_address).start()
        except OSError as exc:
            raise click.UsageError(
                f"cannot listen on {metrics_address}:{metrics_port}: {exc.strerror}"
            ) from exc
        emit(log, "relay.endpoints", address=metrics_address, port=endpoints.port)
    try:
        runner.start()
        freeze_startup_heap()
        collect_young_less_often(settings.batch_size)
        stats = runner.run(drain=drain)
    finally:
        if endpoints is not None:
            endpoints.close()
    if log_format == "json":  # log shippers want every stderr line to be JSON
        emit(
            log,
            "relay.stopped",
            published=stats.messages_published,
            committed=stats.batches_committed,
            rolled_back=stats.batches_rolled_back,
            dead_letters=stats.dead_letters,
            duplicates_possible=stats.duplicates_possible,
            slowest_claim_ms=round(stats.slowest_claim * 1000, 1),
            largest_claim=stats.largest_claim,
        )
    else:
        click.echo(
            f"relay stopped: {stats.messages_published} published, "
            f"{stats.batches_committed} batches committed, {stats.dead_letters} dead letters",
            err=True,
        )
