"""Per-key ordering: which rows of a batch go out together, and which are held back.

Rows sharing an ``ordering_key`` reach the broker in id order.  The rule the relay
keeps is: **a message is published only after the broker confirmed every earlier
message of its key** (confirmed: acknowledged, and not returned as unroutable).

- Across batches the claim keeps it (``queries.sql``, ``claim_batch``): a key's
  rows are claimed only as a prefix of the key, and only once no earlier row of
  the key is left in the outbox, i.e. once the batch holding it is committed,
  which happens only after the broker confirmed it.  A batch rolled back, by its
  relay or by the resolver, puts its rows back in front of the key's later rows.
- Within a batch a key may have several rows.  They go out in **waves**
  (``waves``): wave *i* holds the *i*-th row of every key (and, in wave 0, every
  row without a key); wave *i + 1* is published only after every message of wave
  *i* was confirmed.  A nack or a lost confirm stops the batch before the next
  wave (it is rolled back and retried whole, so nothing of a key overtakes).
- A dead letter inside a key (``hold``): with ``ordering_dead_letters = block``
  (the default) every later row of the key follows it into the dead letters,
  with a reason naming it, whether it is in the same batch, in a later wave
  (a row returned as unroutable), or claimed later (the claim reports
  ``held_by``).  ``dead-letters retry --ordering-key`` puts them all back, in
  order.  With ``skip`` the later rows go on and a retried dead letter arrives
  after them.

Pure: no I/O.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence

from outbox.message import DeadLetter, OutboxRow


def waves(rows: Sequence[OutboxRow]) -> list[list[OutboxRow]]:
    """The rows in publishing waves: wave *i* is the *i*-th row (by id) of each key;
    rows without a key all go in wave 0.  Each wave is in id order."""
    first: list[OutboxRow] = []
    result = [first]
    seen: dict[str, int] = {}  # key → its rows so far
    for row in sorted(rows, key=_by_id):
        key = row.ordering_key
        if key is None:
            first.append(row)
            continue
        wave = seen.get(key, 0)
        seen[key] = wave + 1
        if wave == len(result):  # a key's rows go one wave further at a time
            result.append([])
        result[wave].append(row)
    return result if first else []  # a row or more: wave 0 has one


_by_id = operator.attrgetter("id")


def blockers(dead: Iterable[DeadLetter]) -> dict[str, int]:
    """For each ordering key among ``dead``, the id of its first dead letter."""
    first: dict[str, int] = {}
    for letter in dead:
        key = letter.row.ordering_key
        if key is not None and (key not in first or letter.row.id < first[key]):
            first[key] = letter.row.id
    return first


def held_reason(key: str, blocker: int) -> str:
    return (
        f"held back: an earlier message of ordering key {key!r} (row {blocker}) is a dead "
        f"letter; retry or purge the key's dead letters (outbox dead-letters retry "
        f"--ordering-key KEY)"
    )


def hold(
    rows: Sequence[OutboxRow], first_dead: Mapping[str, int]
) -> tuple[list[DeadLetter], list[OutboxRow]]:
    """Split ``rows`` into those held behind a dead letter of their key and the rest.

    A row is held when the claim found an earlier dead letter of its key
    (``held_by``) or when ``first_dead`` (``blockers``) names one with a lower id.
    """
    held: list[DeadLetter] = []
    free: list[OutboxRow] = []
    for row in rows:
        blocker = row.held_by
        key = row.ordering_key
        if key is not None and key in first_dead and first_dead[key] < row.id:
            blocker = first_dead[key] if blocker is None else min(blocker, first_dead[key])
        if blocker is None or key is None:
            free.append(row)
        else:
            held.append(DeadLetter(row, held_reason(key, blocker)))
    return held, free
