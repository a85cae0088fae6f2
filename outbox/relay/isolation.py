"""Which row makes the broker refuse a batch: isolate it, then dead-letter it.

When RabbitMQ closes the channel or the connection because of something that
was published (a header it will not route on, a frame it cannot read, ...),
every unconfirmed message is in doubt and the batch is rolled back.  The close
does not say which message caused it, so rolling back and sending the same
batch again would loop forever, duplicating the good rows each time.

Instead, every row the refused batch had sent without a confirm becomes a
*suspect*.  The relay publishes suspects one at a time, each confirmed before
anything else goes out, so the next refusal names its row; a row refused alone
``refusals_alone`` times becomes a dead letter with the broker's reason, and the
others flow.  A suspect accepted alone is cleared.  Only refusals count:
outages, timeouts and nacks are transient and never make a row a suspect.

``Suspects`` also remembers verdicts learnt after publishing (a returned row in
a batch that was then rolled back), so the next attempt knows them before it
publishes anything.  It is per relay, bounded in size, and forgets after ``ttl``.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import time
from collections.abc import Callable, Iterable

# Reply codes of a channel or connection close that mean "this publish is refused":
# access refused, not found, precondition failed, frame/syntax/command errors,
# unexpected frame, not allowed, not implemented.  Not 320 (broker shutting down),
# 504 (channel error: ours), 506 (resource error) or 541 (internal error):
# those pass.
REFUSAL_CODES = frozenset({403, 404, 406, 501, 502, 503, 505, 530, 540})
_REPLY = re.compile(r"\b([1-9]\d\d) [A-Z][A-Z_]+\b")

REFUSALS_ALONE = 2
SUSPECT_TTL_SECONDS = 600.0
CAPACITY = 10_000


def refusal_code(reason: str) -> int | None:
    """The refusal reply code in a channel/connection close reason, or None."""
    match = _REPLY.search(reason)
    if match is None:
        return None
    code = int(match[1])
    return code if code in REFUSAL_CODES else None


@dataclasses.dataclass
class _Entry:
    reason: str
    until: float
    refusals_alone: int = 0
    verdict: str | None = None


class Suspects:
    """Rows under suspicion after a refusal, and verdicts learnt about rows, by row id."""

    def __init__(
        self,
        *,
        refusals_alone: int = REFUSALS_ALONE,
        ttl: float = SUSPECT_TTL_SECONDS,
        capacity: int = CAPACITY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.refusals_alone = refusals_alone
        self.ttl = ttl
        self.capacity = capacity
        self._clock = clock
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    @property
    def empty(self) -> bool:
        """No row is under suspicion or has a verdict: the usual case, answered
        without a look per row (entries past their ``ttl`` still count here)."""
        return not self._entries

    def _live(self, row_id: int) -> _Entry | None:
        entry = self._entries.get(row_id)
        if entry is not None and entry.until <= self._clock():
            del self._entries[row_id]
            return None
        return entry

    def _expire(self) -> None:
        now = self._clock()
        for row_id in [r for r, e in self._entries.items() if e.until <= now]:
            del self._entries[row_id]

    def _entry(self, row_id: int, reason: str) -> _Entry:
        entry = self._live(row_id)
        if entry is None:
            entry = self._entries[row_id] = _Entry(reason, 0.0)
        entry.reason = reason
        entry.until = self._clock() + self.ttl
        self._entries.move_to_end(row_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return entry

    def is_suspect(self, row_id: int) -> bool:
        """Still to be published alone (suspected, and no verdict yet)."""
        entry = self._live(row_id)
        return entry is not None and entry.verdict is None

    def verdict(self, row_id: int) -> str | None:
        """Why the row is a dead letter, once that is known; else None."""
        entry = self._live(row_id)
        return entry.verdict if entry is not None else None

    def refused(self, row_id: int, reason: str, *, alone: bool) -> None:
        """The broker refused a batch this row was in flight in (``alone``: only it).

        Reasons that are no refusal (``refusal_code`` None) are ignored.
        """
        if refusal_code(reason) is None:
            return
        entry = self._entry(row_id, reason)
        if alone:
            entry.refusals_alone += 1
            if entry.refusals_alone >= self.refusals_alone and entry.verdict is None:
                entry.verdict = (
                    f"the broker refused it {entry.refusals_alone} times when it was "
                    f"published alone: {reason}"
                )

    def condemn(self, row_id: int, reason: str) -> None:
        """Remember a verdict learnt after publishing (the batch may yet roll back)."""
        self._entry(row_id, reason).verdict = reason

    def clear(self, row_ids: Iterable[int]) -> None:
        """The rows were accepted alone, or their batch committed: forget them."""
        if not self._entries:
            return  # the usual case, once per committed batch
        for row_id in row_ids:
            self._entries.pop(row_id, None)
