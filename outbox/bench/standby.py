"""A hot standby of the bench's private cluster, for the ``physical-slot`` holder.

A physical replication slot holds a table's dead rows only through its standby:
with ``hot_standby_feedback = on`` the standby reports its oldest snapshot's xmin
and the primary keeps it as the slot's ``xmin``.  A bare physical slot (no standby
streaming) holds no xmin at all, only WAL.  So the holder is the real thing: a
``pg_basebackup -R -C -S <slot>`` of the primary (the slot made by the backup),
started beside it with ``hot_standby_feedback = on`` and a status interval of a
second, and a REPEATABLE READ transaction open on the standby, whose xmin the
feedback pins on the primary's slot.  Seconds for the bench's fresh cluster; the
server must be local (its binaries and a port on this machine).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import psycopg

from outbox.db import session
from outbox.db.devcluster import PostgresCluster, standby_of
from outbox.errors import OutboxError

# The standby's feedback, and so the slot's xmin, follows its snapshots this often.
STATUS_INTERVAL_SECONDS = 1
# How long the primary may take to show the standby's xmin on the slot.
FEEDBACK_TIMEOUT_SECONDS = 30.0


@contextlib.contextmanager
def standby_holding(primary_dsn: str, slot: str) -> Iterator[None]:
    """A standby of ``primary_dsn`` streaming through the physical slot ``slot``,
    holding a REPEATABLE READ snapshot until the block ends; then the standby is
    stopped, its folder removed and the slot dropped."""
    cluster: PostgresCluster | None = None
    try:
        cluster = standby_of(
            primary_dsn,
            backup_options=(
                "-C",  # the slot, made by the backup (so no WAL is missed)
                *("-S", slot),
            ),
            settings={
                "hot_standby": "on",
                "hot_standby_feedback": "on",
                "wal_receiver_status_interval": str(STATUS_INTERVAL_SECONDS),
            },
        )
        with session.connect(cluster.dsn, application_name="outbox-bench-standby") as standby:
            standby.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            standby.execute("SELECT 1")
            _wait_slot_xmin(primary_dsn, slot)
            yield
    finally:
        if cluster is not None:
            cluster.destroy()
        drop_slot(primary_dsn, slot)


def drop_slot(primary_dsn: str, slot: str) -> None:
    """Drop ``slot`` once its walsender has seen the standby go (it is active until
    then: a moment after an immediate stop)."""
    deadline = time.monotonic() + FEEDBACK_TIMEOUT_SECONDS
    with session.connect(primary_dsn, application_name="outbox-bench") as primary:
        while True:
            try:
                primary.execute(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                    "WHERE slot_name = %s",
                    [slot],
                )
                return
            except psycopg.errors.ObjectInUse:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def _wait_slot_xmin(primary_dsn: str, slot: str) -> None:
    deadline = time.monotonic() + FEEDBACK_TIMEOUT_SECONDS
    with session.connect(primary_dsn, application_name="outbox-bench") as primary:
        while time.monotonic() < deadline:
            row = primary.execute(
                "SELECT xmin IS NOT NULL AS held FROM pg_replication_slots WHERE slot_name = %s",
                [slot],
            ).fetchone()
            if row and row["held"]:
                return
            time.sleep(0.1)
    raise OutboxError(
        f"the standby's hot_standby_feedback did not set slot {slot}'s xmin "
        f"in {FEEDBACK_TIMEOUT_SECONDS:.0f} s"
    )
