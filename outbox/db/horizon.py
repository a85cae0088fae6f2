"""What holds the MVCC horizon back, and the outbox's dead rows (``horizon.sql``).

Every row the relay deletes stays in the table, dead, until no snapshot can see it
any more; the oldest snapshot of the database decides (DESIGN, "Facts for the MVCC
horizon").  ``HorizonReader`` names who holds it: sessions (``backend_xmin``, e.g. a
report or ``pg_dump`` in REPEATABLE READ, a session idle in transaction),
replication slots (``xmin``, ``catalog_xmin``) and prepared transactions (ours
included); and what it costs: the outbox's dead rows and size.  ``outbox status``,
the relay's metrics endpoint and the console read it; so does ``outbox bench``.

The reader is a ``BatchStore``: ``status`` and the metrics endpoint read the
batches' figures and the horizon on one session, bounded by ``statement_timeout``
and ``lock_timeout`` like every operator tool's.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from psycopg import sql

from outbox.db.batches import BatchStore
from outbox.db.queries import load_blocks

# Holders listed per kind (sessions, slots, prepared transactions), oldest first.
HOLDERS_SHOWN = 5


@dataclasses.dataclass(frozen=True)
class Holder:
    """One thing that holds the horizon back."""

    kind: str  # session | replication_slot | prepared_transaction
    name: str  # "pid 1234", the slot's name, the gid
    xmin_age_xids: int  # transactions since its horizon; 0 if it holds only catalogs
    age_seconds: float | None  # how long (a session's transaction, a prepared xact); None: unknown
    # Holds the outbox's dead rows (False: a logical slot's catalog_xmin, which holds
    # only the system catalogs).
    holds_outbox: bool
    detail: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Horizon:
    holders: list[Holder]  # oldest first
    hidden_sessions: int  # other roles' sessions whose xmin this role may not read
    dead_rows: int | None  # None: the outbox has no statistics yet
    live_rows: int | None
    table_bytes: int | None
    last_vacuum: datetime.datetime | None

    @property
    def age_xids(self) -> int:
        """How many transactions the oldest holder of the outbox's dead rows is behind."""
        return max((h.xmin_age_xids for h in self.holders if h.holds_outbox), default=0)

    @property
    def age_seconds(self) -> float:
        """How long the oldest holder with a known age has held it (0: none)."""
        return max(
            (h.age_seconds for h in self.holders if h.holds_outbox and h.age_seconds is not None),
            default=0.0,
        )

    @property
    def oldest(self) -> Holder | None:
        return next((h for h in self.holders if h.holds_outbox), None)


class HorizonReader(BatchStore):
    """A ``BatchStore`` that also reads the horizon (``horizon``)."""

    def __init__(self, dsn: str, table: str, **kwargs: Any) -> None:
        super().__init__(dsn, table, **kwargs)
        self._horizon = {
            name: sql.SQL(body) for name, body in load_blocks("outbox.db", "horizon.sql").items()
        }

    def horizon(self, limit: int = HOLDERS_SHOWN) -> Horizon:
        params = {"limit": limit, "table": self.table}
        # One transaction: every age is measured from the same now() (each statement
        # in autocommit has its own), so holders of the same xid age rank by how long
        # they have held it however slowly the five statements come.
        with self._translated("reading what holds the horizon"), self.conn.transaction():
            sessions = self.conn.execute(self._horizon["horizon_sessions"], params).fetchall()
            hidden = self.conn.execute(self._horizon["horizon_hidden_sessions"]).fetchone()
            slots = self.conn.execute(self._horizon["horizon_slots"], params).fetchall()
            prepared = self.conn.execute(self._horizon["horizon_prepared"], params).fetchall()
            table = self.conn.execute(self._horizon["outbox_dead_rows"], params).fetchone()
        holders = [session_holder(r) for r in sessions]
        holders += [slot_holder(r) for r in slots]
        holders += [
            Holder(
                "prepared_transaction",
                r["gid"],
                int(r["xmin_age_xids"]),
                float(r["age_seconds"]),
                True,
                {"owner": r["owner"], "database": r["database"]},
            )
            for r in prepared
        ]
        holders.sort(key=ranked, reverse=True)
        return Horizon(
            holders=holders,
            hidden_sessions=int(hidden["hidden"]) if hidden else 0,
            dead_rows=table["dead_rows"] if table else None,
            live_rows=table["live_rows"] if table else None,
            table_bytes=table["table_bytes"] if table else None,
            last_vacuum=table["last_vacuum"] if table else None,
        )


def ranked(holder: Holder) -> tuple[int, float]:
    """Oldest first, by transactions; among holders of the same age, the one that has
    held it longest.  A snapshot taken while the oldest transaction runs has that
    transaction's xid as its xmin: the same age, but it came later (the console's own
    statement, say), so the older holder is named first."""
    return holder.xmin_age_xids, holder.age_seconds or 0.0


def session_holder(row: dict[str, Any]) -> Holder:
    return Holder(
        "session",
        f"pid {row['pid']}",
        int(row["xmin_age_xids"]),
        None if row["xact_age_seconds"] is None else float(row["xact_age_seconds"]),
        True,
        {
            "pid": row["pid"],
            "application_name": row["application_name"],
            "state": row["state"],
            "role": row["role"],
            "database": row["database"],
            "backend_type": row["backend_type"],
            "client_addr": row["client_addr"],
            "state_age_seconds": row["state_age_seconds"],
            "query": row["query"],
        },
    )


def slot_holder(row: dict[str, Any]) -> Holder:
    holds_data = row["xmin_age_xids"] is not None
    age = row["xmin_age_xids"] if holds_data else row["catalog_xmin_age_xids"]
    return Holder(
        "replication_slot",
        row["slot_name"],
        int(age or 0),
        None,
        holds_data,
        {
            "slot_type": row["slot_type"],
            "database": row["database"],
            "active": row["active"],
            "active_pid": row["active_pid"],
            "catalog_xmin_age_xids": row["catalog_xmin_age_xids"],
        },
    )
