"""The one quarantine: messages that cannot go on as they are, kept whole for an
operator to list, look at, retry once the cause is fixed, or purge.

Two stores hold one each and answer the same port (``Store``):

- the relay's dead letters (``outbox.db.deadletters.DeadLetterStore``, ``outbox
  dead-letters``): outbox rows that could not be published; a retry moves them back
  into the outbox in one statement (``outbox.ops.deadletters``);
- the consumer's parked messages (``outbox.db.inbox.ParkedStore``, ``outbox
  parked``): messages the consumer gave up on; a retry sends them back to the queue
  each was parked from (``outbox.inbox.parked``).

Each is a ``Kind`` (``outbox.ops.deadletters.DEAD_LETTERS``,
``outbox.ops.parked.PARKED``).  Both commands (``outbox.cli.quarantine``) and the
console (``outbox.web.quarantine``) go through this module: one way to open and
close a store (``opened``), one list output (``listed``), one purge selection
(``purge_refusal``), one report of what was done (``Kind``'s sentences).  What
differs is only what a ``Kind`` names, and how a retry works.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

from outbox.db.session import OperatorBounds

Row = dict[str, Any]


class Store(Protocol):
    """What a quarantine's store answers (each call one transaction of its own)."""

    def entries(self, limit: int, /) -> list[Row]:
        """The oldest ``limit`` entries, oldest first."""

    def entry(self, number: int, most: int, /) -> Row | None:
        """Entry ``number`` with the first ``most`` bytes of its message, or None."""

    def search(self, text: str, limit: int, offset: int, /) -> list[Row]:
        """A page of the entries whose number is ``text`` or whose texts contain it,
        each with the ``total`` that match."""

    def value(self, number: int, what: str, most: int, /) -> Row | None:
        """The ``size`` of one of an entry's values, and the ``value`` itself if it
        has at most ``most`` bytes."""

    def close(self) -> None: ...


S = TypeVar("S", bound=Store)


class Bounded(Protocol):
    """What knows an operator's bounds: the relay's settings, a console's inbox."""

    @property
    def connect_timeout(self) -> float: ...
    @property
    def statement_timeout(self) -> float: ...
    @property
    def lock_timeout(self) -> float: ...


def bounds_of(where: Bounded) -> OperatorBounds:
    return OperatorBounds(where.connect_timeout, where.statement_timeout, where.lock_timeout)


@contextlib.contextmanager
def opened(open_store: Callable[[], S]) -> Iterator[S]:
    """A store for one command or one request: closed after it, whatever happened."""
    store = open_store()
    try:
        yield store
    finally:
        store.close()


@dataclasses.dataclass(frozen=True)
class Kind:
    """What one quarantine holds, in the words its command and pages use."""

    noun: str  # one entry: "dead letter"
    title: str  # a page's: "Dead letters"
    name: str  # the list's JSON key ({name: [...]}), the console's audit events'
    command: str  # its command, and its pages' path: "dead-letters"
    retried: str  # what a retry did to the entries: "moved back to the outbox"
    not_found: str  # before names that matched none: "not dead letters"
    downloads: tuple[str, ...]  # an entry's values a console download sends whole
    as_dict: Callable[[Row], Row]  # an entry as JSON-ready data
    render: Callable[[Sequence[Row]], str]  # entries as lines for a terminal

    def count(self, count: int) -> str:
        """``1 dead letter``, ``2 dead letters``."""
        return f"{count} {self.noun}{'' if count == 1 else 's'}"

    def retry_done(self, count: int) -> str:
        """What a command says after a retry (the count's noun always plural, as
        scripts that read it expect)."""
        return f"{count} {self.noun}s {self.retried}"

    def purge_done(self, count: int) -> str:
        return f"{count} {self.noun}s purged"


def listed(kind: Kind, rows: Sequence[Row], *, as_json: bool) -> str:
    """``list``'s output: one JSON document, or the lines of ``kind.render``."""
    if as_json:
        return json.dumps({kind.name: [kind.as_dict(r) for r in rows]}, indent=2, default=str)
    return kind.render(rows)


def purge_refusal(
    everything: bool, named: bool, older_than: str | None, names: Sequence[str]
) -> str | None:
    """Why a purge of ``--all``, ``--older-than`` and the ``names`` it was given
    (``named``) is not one: both --all and names, or nothing at all (pure)."""
    if everything and named:
        alternatives = "".join(f" (or {name})" for name in names[1:])
        return f"give --all or {names[0]}{alternatives}, not both"
    if not (everything or named or older_than):
        *first, last = ["--all", "--older-than AGE", *names]
        return f"say what to purge: {', '.join(first)} or {last}"
    return None
