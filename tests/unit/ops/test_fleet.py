"""A fleet's ``status`` and ``resolve`` around the single-database commands (pure:
the work each database gets is a stand-in here; tests/integration/ops/test_fleet_ops.py
runs the real ones)."""

from __future__ import annotations

import threading

import pytest

from outbox.config import Settings
from outbox.errors import DatabaseUnavailable
from outbox.fleet.targets import Target
from outbox.ops import fleet, status

TARGETS = [Target("a", "dbname=a"), Target("b", "dbname=b"), Target("c", "dbname=c")]


def report_of(backlog: int, attention: list[str] | None = None) -> dict[str, object]:
    return {
        "table": "outbox",
        "backlog_rows": backlog,
        "oldest_row_age_seconds": 1.5,
        "prepared_batches": [],
        "oldest_prepared_age_seconds": 0.0,
        "dead_letters": 0,
        "live_relays": 1,
        "scheduled_rows": 0,
        "attention": attention or [],
        "warnings": [],
    }


def test_each__runs_the_databases_together_and_keeps_each_failure_to_its_own() -> None:
    together = threading.Barrier(3, timeout=30)  # broken unless all three run at once

    def work(settings: Settings) -> str:
        together.wait()
        if settings.dsn == "dbname=b":
            raise DatabaseUnavailable("cannot connect to b", "start it")
        if settings.dsn == "dbname=c":
            raise RuntimeError("a bug")
        return settings.dsn

    a, b, c = fleet.each(TARGETS, Settings(), work, at_once=3)
    assert (a.database, a.result, a.failed) == ("a", "dbname=a", False)
    assert (b.error, b.hint, b.exit_code) == ("cannot connect to b", "start it", 3)
    assert c.failed and "RuntimeError: a bug" in (c.error or "")
    assert fleet.exit_code([a]) == 0 and fleet.exit_code([a, b]) == 1


def test_status__a_line_per_database_and_a_summary(monkeypatch: pytest.MonkeyPatch) -> None:
    def collect(settings: Settings, **_: object) -> dict[str, object]:
        if settings.dsn == "dbname=c":
            raise DatabaseUnavailable('database "c" does not exist', "check the targets")
        late = ["the oldest outbox row is 400s old"] if settings.dsn == "dbname=b" else []
        return report_of(10, late)

    monkeypatch.setattr(status, "collect", collect)
    report = fleet.collect(TARGETS, Settings(), max_prepared_age=60)
    assert [d["state"] for d in report["databases"]] == ["ok", "attention", "error"]
    assert report["attention"] == [
        "b: the oldest outbox row is 400s old",
        'c: cannot be read: database "c" does not exist (check the targets)',
    ]
    assert report["summary"]["backlog_rows"] == 20
    text = fleet.render(report).splitlines()
    assert text[1].startswith("a ") and text[1].endswith(" ok")
    assert text[2].endswith("needs attention")
    assert 'unreachable: database "c" does not exist' in text[4]
    assert text[-1].startswith("3 databases: 1 all good, 1 need attention, 1 cannot be read")


def test_status__no_database_at_all_needs_attention() -> None:
    report = fleet.collect([], Settings(), max_prepared_age=60)
    assert report["attention"] and "no database" in fleet.render(report)
