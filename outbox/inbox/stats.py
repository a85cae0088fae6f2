"""The consumer's counters (``ConsumerStats``: its metrics, health and summary read
them) and why a message is parked (``PARK_REASONS``, the metric's ``reason``)."""

from __future__ import annotations

import dataclasses

from outbox.durations import Durations
from outbox.health import LoopStats

# Why a message was parked (``ConsumerStats.parked_by``, the metric's ``reason``):
# its handler kept failing; its last attempt has no known outcome (``Plan.PARK``: the
# handler may kill the process); it cannot be deduplicated (no message_id, or
# properties that cannot be read).
PARK_REASONS = ("failed", "unfinished", "unusable")


@dataclasses.dataclass
class ConsumerStats(LoopStats):
    """Counters of one consumer process; its loop's ``reconnects``,
    ``last_progress`` and ``last_error`` are ``LoopStats``'."""

    handled: int = 0
    duplicates_skipped: int = 0
    handler_failures: int = 0
    retried: int = 0
    parked: int = 0  # all reasons
    parked_by: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(PARK_REASONS, 0)
    )
    # Messages taken into custody (``outbox.inbox.custody``), and how many custody
    # held when the loop last looked.
    custody_taken: int = 0
    custody_held: int = 0
    pruned: int = 0
    handler_seconds: Durations = dataclasses.field(default_factory=Durations)
