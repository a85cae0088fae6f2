"""Counters of one relay process: exported as metrics, shown in logs and by the bench."""

from __future__ import annotations

import collections
import dataclasses

from outbox.durations import Durations
from outbox.health import LoopStats


@dataclasses.dataclass
class Stats(LoopStats):
    """Counters of one relay process (exported as metrics, shown in logs); its
    loop's ``reconnects``, ``last_progress`` and ``last_error`` are ``LoopStats``'."""

    batches_committed: int = 0
    batches_rolled_back: int = 0
    batches_resolved: int = 0
    messages_published: int = 0
    dead_letters: int = 0
    scheduled_moved: int = 0  # scheduled rows this relay moved into the outbox when due
    # Messages accepted, or sent and never confirmed, in batches then rolled back.
    duplicates_possible: int = 0
    batch_seconds: Durations = dataclasses.field(default_factory=Durations)  # committed batches
    claim_seconds: Durations = dataclasses.field(default_factory=Durations)  # every claim
    slowest_claim: float = 0.0  # seconds
    largest_claim: int = 0  # rows; never more than batch_size
    # Failures of each relay write (claim, prepare, dead_letters, ledger,
    # commit_prepared, rollback_prepared): ``relay.batches``, "A write that keeps failing".
    write_failures: collections.Counter[str] = dataclasses.field(
        default_factory=collections.Counter
    )

    def summary(self) -> dict[str, object]:
        """The fields of the ``relay.stopped`` event."""
        return {
            "published": self.messages_published,
            "committed": self.batches_committed,
            "rolled_back": self.batches_rolled_back,
            "dead_letters": self.dead_letters,
            "duplicates_possible": self.duplicates_possible,
            "slowest_claim_ms": round(self.slowest_claim * 1000, 1),
            "largest_claim": self.largest_claim,
        }
