"""Global transaction ids of relay batches, and the relay identity inside them.

A batch's gid is ``obx:<table>:<relay_id>:<seq>``:

- ``obx`` marks the prepared transaction as ours; anything else in
  ``pg_prepared_xacts`` is foreign and never touched;
- ``table`` keeps two outbox tables in one database apart;
- ``relay_id`` is 32 random hex digits chosen when a relay starts, so a gid is never
  reused, not even by a relay restarted after a crash.  A reused gid could find an
  old ledger record and be committed without evidence: that would lose rows;
- ``seq`` counts the relay's batches.

The relay's control session holds the advisory lock ``(LOCK_CLASS, lock_key)``
while the relay lives; ``lock_key`` is derived from ``relay_id``, so a resolver
can test a gid's owner for life from the gid alone.  A relay that lost its
control session but not its process (a database restart or failover) takes the
same id back (``outbox.relay.liveness``): its batches stay its own.  A relay
restarted is a new process and always draws a new id.
"""

from __future__ import annotations

import dataclasses
import re
import secrets

PREFIX = "obx"
# First key of the relay advisory locks ("obx" in ASCII); keeps them apart from an
# application's own advisory locks.
LOCK_CLASS = 0x6F6278
# First key of the hand-over lock ``(HANDOVER_LOCK_CLASS, lock_key)``: held, briefly,
# by whoever takes a relay id whose control session is gone: the relay itself
# taking its id back after an outage (``outbox.db.relays.ControlSession.reclaim``),
# or a resolver finishing that id's batches (``resolver.apply``), for its whole
# pass.  So the two never act on one relay id's batches at once.
HANDOVER_LOCK_CLASS = 0x6F627A
# First key of the wake-up lock ``(WAKEUP_LOCK_CLASS, <the outbox table's oid>)``: an
# idle relay holds it in shared mode, and the outbox trigger notifies only while
# someone holds it (schema 0005, ``outbox.db.relays.WakeupListener``).  The migration
# spells the number out; ``tests/unit/test_gid.py`` checks that they agree.
WAKEUP_LOCK_CLASS = 0x6F6279

_GID = re.compile(r"^obx:([a-z_][a-z0-9_]*):([0-9a-f]{32}):([0-9]+)$")


def new_relay_id() -> str:
    return secrets.token_hex(16)


def lock_key(relay_id: str) -> int:
    """A non-negative int4 from the relay id (fits both int4 and oid)."""
    return int(relay_id[:8], 16) & 0x7FFFFFFF


@dataclasses.dataclass(frozen=True, order=True)
class Gid:
    table: str
    relay_id: str
    seq: int

    def __str__(self) -> str:
        return f"{PREFIX}:{self.table}:{self.relay_id}:{self.seq}"


def parse(text: str) -> Gid | None:
    """The gid's parts, or None for a prepared transaction that is not a relay batch."""
    match = _GID.match(text)
    if match is None:
        return None
    return Gid(match.group(1), match.group(2), int(match.group(3)))


def relay_prefix(table: str) -> str:
    """The text every gid of ``table`` starts with (for LIKE filters)."""
    return f"{PREFIX}:{table}:"
