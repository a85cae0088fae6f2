"""Load ``queries.sql`` into composed statements for one outbox table.

``inbox.sql`` (the consumer's inbox, ``outbox.db.inbox``) uses the same loader.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

from psycopg import sql

from outbox.tables import table_identifiers

_BLOCK = re.compile(r"^-- ([a-z_]+) --$", re.MULTILINE)


def _raw_blocks() -> dict[str, str]:
    return load_blocks("outbox.db", "queries.sql")


@cache
def load_blocks(package: str, filename: str) -> dict[str, str]:
    """The named blocks of one SQL file of a package, comments stripped."""
    text = resources.files(package).joinpath(filename).read_text("utf-8")
    parts = _BLOCK.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    blocks: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=False):
        lines = [ln for ln in body.strip().splitlines() if not ln.lstrip().startswith("--")]
        blocks[name] = "\n".join(lines).strip()
    return blocks


class Queries:
    """Every statement of ``queries.sql``, composed for one table name."""

    def __init__(self, table: str) -> None:
        ids = table_identifiers(table)
        raw = _raw_blocks()
        # ``{rows_waiting}``: the idle poll's look, written once, also inside want_wakeups
        # and, with ``{orphaned_batches}``, inside dormant_look;
        # ``{front_rows}``: the rows where the claims look, in backlog;
        # ``{backlog}``: the backlog counted over them, in chart_sample and metrics_snapshot.
        # ``{front_rows_saved}``: the same rows with the front read in the statement
        # (its CTE ``front``), in scaler_backlog, which takes no parameter;
        # ``{net_columns}``: the safety net's schedule, in saved_front and locked_front.
        front_rows = sql.SQL(raw["front_rows"]).format(**ids)
        front_rows_saved = raw["front_rows"]
        for name in ("low_water", "late", "seen"):
            front_rows_saved = front_rows_saved.replace(
                f"%({name})s", f"(SELECT {name} FROM front)"
            )
        parts = {
            **ids,
            "outbox_name": sql.Literal(table),
            "rows_waiting": sql.SQL(raw["rows_waiting"]).format(**ids),
            "orphaned_batches": sql.SQL(raw["orphaned_batches"]).format(**ids),
            "front_rows": front_rows,
            "front_rows_saved": sql.SQL(front_rows_saved).format(**ids),
            "backlog": sql.SQL(raw["backlog"]).format(**ids, front_rows=front_rows),
            "net_columns": sql.SQL(raw["net_columns"]),
        }
        self._composed = {name: sql.SQL(body).format(**parts) for name, body in raw.items()}

    def __getitem__(self, name: str) -> sql.Composed:
        return self._composed[name]


def scaler_statement(table: str) -> str:
    """``scaler_backlog`` for ``table`` as plain text: what an autoscaler's
    configuration holds (it takes no parameter)."""
    return Queries(table)["scaler_backlog"].as_string(None)


# What a list (a command's, a console page's) shows of each row: text cut at
# ``chars`` characters and headers only up to ``headers_bytes`` of JSON, so that it
# holds at most its limit of rows of this size, whatever a row holds.
LISTED: dict[str, int] = {"chars": 1000, "headers_bytes": 8192}


def search_terms(text: str) -> dict[str, str]:
    """The parameters of a console search for ``text``: itself (``q``, compared with
    a row's number) and an ILIKE pattern of it (``like``, its wildcards escaped)."""
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return {"q": text, "like": f"%{escaped}%"}
