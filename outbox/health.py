"""Liveness and readiness of a relay process (pure decisions; the consumer's
readiness is ``outbox.inbox.metrics``'s, its liveness is this one), from what both
processes' loops record (``LoopStats``).

- Liveness (``/healthz``): the relay loop still goes round.  It stays true during
  a database or broker outage (the loop is then backing off, which is progress):
  restarting a relay cannot fix a server that is down.
- Readiness (``/readyz``): the relay can do its work right now: both servers are
  reachable and the loop's last pass succeeded.
"""

from __future__ import annotations

import dataclasses
import time

from outbox.config import Settings
from outbox.redaction import redact

# Added to the computed worst case of one loop pass before the relay counts as stuck.
LIVENESS_MARGIN = 60.0


@dataclasses.dataclass
class LoopStats:
    """What a process's loop records for its probes and metrics, the relay's
    (``outbox.relay.stats.Stats``) and the consumer's
    (``outbox.inbox.stats.ConsumerStats``) alike: when it last went round, why its
    last pass failed, and how often it reconnected after a server failed."""

    reconnects: int = 0
    last_progress: float = dataclasses.field(default_factory=time.monotonic)
    last_error: str | None = None


@dataclasses.dataclass(frozen=True)
class Check:
    ok: bool
    problems: tuple[str, ...] = ()

    def body(self) -> str:
        # A problem may quote a driver's error, and a driver may quote a password.
        return "ok\n" if self.ok else redact("".join(f"{p}\n" for p in self.problems))


def liveness_limit(settings: Settings) -> float:
    """The longest a healthy pass of the relay loop can take (seconds), plus a margin.

    A pass may wait for confirms of a batch and of its ledger record, read the
    ledger in a resolver pass, back off, and reconnect to both servers.
    """
    return (
        3 * settings.publish_timeout
        + settings.backoff_max
        + 4 * settings.connect_timeout
        + max(settings.poll_interval, settings.heartbeat_interval)
        + LIVENESS_MARGIN
    )


def liveness(*, seconds_since_progress: float, limit: float, loop: str = "the relay loop") -> Check:
    if seconds_since_progress <= limit:
        return Check(True)
    return Check(
        False,
        (f"{loop} has not gone round for {seconds_since_progress:.0f}s (> {limit:.0f}s)",),
    )


def readiness(
    *,
    started: bool,
    stopping: bool,
    broker_connected: bool,
    last_error: str | None,
    database_error: str | None,
) -> Check:
    problems = []
    if stopping:
        problems.append("the relay is stopping")
    if not started:
        problems.append("the relay has not connected yet")
    if database_error is not None:
        problems.append(f"database: {database_error}")
    if started and not broker_connected:
        problems.append("broker: not connected to RabbitMQ")
    if last_error is not None:
        problems.append(f"last pass failed: {last_error}")
    return Check(not problems, tuple(problems))
