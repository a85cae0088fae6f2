"""The fleet's ``/metrics``, ``/healthz`` and ``/readyz``.

- ``/metrics``: every relay metric of every target, labelled ``database`` (the
  target's name), as a single relay's are labelled with its database
  (``outbox.relay.metrics.RelayCollector``), so dashboards and alerts have one shape.
  A target's database figures (backlog, prepared batches, ...) are read on a
  session opened for the read and closed after it (``PassingFigures``), at most once
  per ``DATABASE_CACHE_SECONDS``: no standing session per target beside the
  relay's own (a dormant target keeps one session, its wake-up listener).
- ``/healthz``: the supervisor goes round (its loop, ``Fleet.run``).
- ``/readyz``: ready when every target is serving or dormant; the body names each
  that is not, and why (starting, retrying after an error, a failing pass).
"""

from __future__ import annotations

from outbox import health
from outbox.fleet.process import DORMANT, SERVING, Fleet, TargetRelay
from outbox.probes import DATABASE_CACHE_SECONDS, Endpoints
from outbox.relay.metrics import DatabaseFigures, Member, RelayCollector


class PassingFigures(DatabaseFigures):
    """``DatabaseFigures`` on a session of their own only while they are read."""

    def refresh(self) -> None:
        super().refresh()
        self.close()


class FleetFigures:
    """One ``PassingFigures`` per target, made when first scraped."""

    def __init__(self, fleet: Fleet, ttl: float) -> None:
        self.fleet = fleet
        self.ttl = ttl
        self._figures: dict[str, PassingFigures] = {}

    def members(self) -> list[Member]:
        members = []
        served = self.fleet.members()
        names = {t.name for t in served}
        for gone in set(self._figures) - names:
            self._figures.pop(gone).close()
        for target in served:
            relay = target.relay
            if relay is None:
                continue
            figures = self._figures.get(target.name)
            if figures is None:
                s = target.settings
                figures = PassingFigures(
                    s.dsn, s.table, connect_timeout=s.connect_timeout, ttl=self.ttl
                )
                self._figures[target.name] = figures
            members.append(Member(target.name, relay, figures))
        return members

    def close(self) -> None:
        for figures in self._figures.values():
            figures.close()
        self._figures.clear()


def target_problem(target: TargetRelay) -> str | None:
    """Why ``target`` is not ready (None: serving or dormant, and its last pass worked)."""
    state = target.state
    if state not in (SERVING, DORMANT):
        why = f": {target.error}" if target.error else ""
        return f"{target.name}: {state}{why}"
    relay = target.relay
    if relay is not None and relay.stats.last_error is not None:
        return f"{target.name}: last pass failed: {relay.stats.last_error}"
    if relay is not None and state == SERVING and not relay.publisher.connected:
        return f"{target.name}: broker: not connected to RabbitMQ"
    return None


class FleetEndpoints(Endpoints):
    """The fleet's endpoints (the module's docstring)."""

    loop = "the fleet's supervisor"

    def __init__(
        self,
        fleet: Fleet,
        *,
        port: int,
        address: str = "0.0.0.0",
        cache_seconds: float = DATABASE_CACHE_SECONDS,
    ) -> None:
        self.fleet = fleet
        self.database = FleetFigures(fleet, cache_seconds)
        super().__init__(
            RelayCollector(members=self.database.members),
            self.database,
            liveness_limit=health.liveness_limit(fleet.settings),
            port=port,
            address=address,
        )

    def last_progress(self) -> float:
        return self.fleet.last_progress

    def readiness(self) -> health.Check:
        if self.fleet.stop:
            return health.Check(False, ("the fleet is stopping",))
        members = self.fleet.members()
        if not members:
            return health.Check(False, (f"no targets in {self.fleet.source.describe()}",))
        problems = [p for p in map(target_problem, members) if p is not None]
        return health.Check(not problems, tuple(problems))
