"""Which claimed rows can never be published: the relay's bad-row triage.

Three sources of proof, none of them a transient failure:

- the row itself (``message.problem_with``: names too long, payload too large,
  headers AMQP cannot carry);
- the broker's topology: the row's exchange does not exist (the caller asks the
  broker about the names ``exchanges_to_check`` gives, by a passive declare, and
  passes the missing ones to ``sort_out``; a name found is trusted for
  ``EXCHANGE_CACHE_SECONDS``);
- what a channel close taught us (``message.refusal_in``): an exchange that
  refuses publishes (403), or the broker's real maximum message size (406).  The
  batch that hit the close is rolled back once as in doubt; from the next attempt
  on, the rows concerned are dead-lettered and the others go through;
- what isolating suspects taught us (``isolation.Suspects``): a row the broker
  refused when it was published alone, for a reason nobody foresaw, and rows
  returned in a batch that was then rolled back.

Pure: no I/O, a clock only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Sequence

from outbox.events import emit
from outbox.message import DeadLetter, OutboxRow, problem_with, refusal_in
from outbox.relay.isolation import Suspects

log = logging.getLogger("outbox.triage")

# How long a verified exchange (or a learnt refusal) is trusted before it is checked again.
EXCHANGE_CACHE_SECONDS = 60.0


class Triage:
    def __init__(self, max_message_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_message_bytes = max_message_bytes
        self._clock = clock
        self._exchanges_seen: dict[str, float] = {}  # exchange → trusted until
        self._exchanges_refused: dict[str, tuple[str, float]] = {}  # → (reason, until)
        self.suspects = Suspects(clock=clock)

    def forget_exchanges(self) -> None:
        """Check every exchange again (a new connection, or one was deleted: 404)."""
        self._exchanges_seen.clear()

    def exchanges_to_check(self, names: Iterable[str]) -> set[str]:
        """The exchanges among ``names`` whose existence is not known (or too old)."""
        now = self._clock()
        return {
            name
            for name in names
            # The default exchange always exists; names too long fail statically.
            if name != ""
            and len(name.encode()) <= 255
            and self._exchanges_seen.get(name, 0.0) <= now
        }

    def exchanges_found(self, names: Iterable[str]) -> None:
        """The broker confirmed these exchanges exist: trust that for a while."""
        until = self._clock() + EXCHANGE_CACHE_SECONDS
        for name in names:
            self._exchanges_seen[name] = until

    def sort_out(
        self, rows: Sequence[OutboxRow], missing: Collection[str] = ()
    ) -> tuple[list[DeadLetter], list[OutboxRow]]:
        """Split rows into those that can never be published and the rest; ``missing``
        are the exchanges the broker said do not exist."""
        dead: list[DeadLetter] = []
        good: list[OutboxRow] = []
        now = self._clock()
        # Usually nothing was refused and nobody is suspect: no look-up per row then.
        refusals = self._exchanges_refused
        suspects = None if self.suspects.empty else self.suspects
        for row in rows:
            reason = problem_with(row, self.max_message_bytes)
            if reason is None and row.exchange in missing:
                reason = f"exchange {row.exchange!r} does not exist"
            refused = refusals.get(row.exchange) if refusals else None
            if reason is None and refused is not None and refused[1] > now:
                reason = refused[0]
            if reason is None and suspects is not None:
                reason = suspects.verdict(row.id)
            if reason is None:
                good.append(row)
            else:
                dead.append(DeadLetter(row, reason))
        return dead, good

    def isolate(self, rows: Sequence[OutboxRow]) -> tuple[list[OutboxRow], list[OutboxRow]]:
        """Split publishable rows into suspects (to publish one at a time) and the rest."""
        if self.suspects.empty:
            return [], list(rows)
        suspects = [r for r in rows if self.suspects.is_suspect(r.id)]
        if not suspects:
            return [], list(rows)
        return suspects, [r for r in rows if not self.suspects.is_suspect(r.id)]

    def learn(self, reasons: Iterable[str]) -> None:
        """Remember what channel-close reasons say can never be published."""
        now = self._clock()
        for exchange, (_reason, until) in list(self._exchanges_refused.items()):
            if until <= now:
                del self._exchanges_refused[exchange]
        for reason in reasons:
            refusal = refusal_in(reason)
            if refusal is None:
                continue
            if refusal.exchange is not None:
                self._exchanges_refused[refusal.exchange] = (
                    refusal.reason,
                    now + EXCHANGE_CACHE_SECONDS,
                )
            if refusal.max_message_bytes is not None:
                self.max_message_bytes = min(self.max_message_bytes, refusal.max_message_bytes)
            emit(log, "broker.refusal_learned", logging.WARNING, reason=refusal.reason)
