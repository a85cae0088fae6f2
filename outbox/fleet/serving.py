"""What ``outbox relay --targets/--discover`` runs: the fleet (``outbox.fleet.process``)
through the life every long-running process has (``outbox.lifecycle``), with the
fleet's endpoints (``outbox.fleet.metrics``)."""

from __future__ import annotations

from outbox import lifecycle
from outbox.fleet.metrics import FleetEndpoints
from outbox.fleet.process import Fleet
from outbox.relay.stats import Stats


def serve(fleet: Fleet, *, metrics_port: int = 0, metrics_address: str = "0.0.0.0") -> Stats:
    """What ``outbox relay --targets/--discover`` runs (``outbox.lifecycle.serve``): the
    endpoints (``outbox.fleet.metrics``), the targets started, the supervisor until
    stopped, every target stopped, the ``fleet.stopped`` event with the counters of
    every target.  Signals are the caller's (``StopFlag.install_signal_handlers``)."""

    def endpoints() -> FleetEndpoints:
        return FleetEndpoints(fleet, port=metrics_port, address=metrics_address)

    return lifecycle.serve(
        "fleet",
        start=fleet.start,
        run=fleet.run,
        close=fleet.close,
        endpoints=endpoints if metrics_port else None,
        stopped="fleet.stopped",
        summary=Stats.summary,
        young_objects=fleet.settings.batch_size,
    )
