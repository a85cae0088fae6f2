"""The fleet's targets: the file's format, names, changes and the discovery rule."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from outbox.errors import InvalidSetting
from outbox.fleet.targets import (
    RECHECK_SECONDS,
    Target,
    TargetSource,
    diff,
    matches,
    named,
    parse_targets,
    target_dsn,
)


def test_a_file_lists_one_dsn_per_line_comments_and_blanks_ignored() -> None:
    text = (
        "# billing and orders\n\n"
        "postgresql://relay@db1/orders\n"
        "  host=db2 dbname=billing user=relay  \n"
    )
    targets = parse_targets(text, source="targets.txt")
    assert [t.name for t in targets] == ["billing", "orders"]
    assert targets[1].dsn == "postgresql://relay@db1/orders"


def test_two_servers_with_one_database_name_are_told_apart_by_server() -> None:
    targets = named(["postgresql://a:5433/shop", "postgresql://b/shop", "postgresql://b/crm"])
    assert [t.name for t in targets] == ["a:5433/shop", "b:5432/shop", "crm"]


def test_a_dsn_given_twice_counts_once() -> None:
    assert len(named(["postgresql://b/shop", "host=b dbname=shop"])) == 1


def test_a_bad_line_names_its_line_never_its_text() -> None:
    with pytest.raises(InvalidSetting) as raised:
        parse_targets("postgresql://ok/db\nmysql://u:S3cret@h/db\n", source="t.txt")
    assert "t.txt, line 2" in raised.value.message
    assert "S3cret" not in str(raised.value)


def test_one_database_as_two_users_is_refused() -> None:
    with pytest.raises(InvalidSetting, match="as different users"):
        named(["postgresql://a@h/shop", "postgresql://b@h/shop"])


def test_diff_says_what_is_added_and_removed_and_a_changed_dsn_is_both() -> None:
    a, b = Target("a", "dbname=a"), Target("b", "dbname=b")
    b2 = Target("b", "dbname=b user=other")
    changes = diff([a, b], [b2, Target("c", "dbname=c")])
    assert [t.name for t in changes.added] == ["b", "c"]
    assert [t.name for t in changes.removed] == ["a", "b"]
    assert not diff([a], [a])


def test_the_discovery_rule_is_shell_patterns_separated_by_commas() -> None:
    assert matches("tenant_07", "tenant_*")
    assert matches("crm", "tenant_*, crm")
    assert not matches("postgres", "tenant_*,crm")
    assert matches("anything", "*")


def test_a_target_dsn_keeps_every_setting_but_the_database() -> None:
    dsn = target_dsn("host=h port=5433 user=relay dbname=postgres sslmode=require", "t1")
    assert "dbname=t1" in dsn and "sslmode=require" in dsn and "port=5433" in dsn


def test_a_targets_file_is_read_again_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "targets"
    path.write_text("dbname=a\n")
    source = TargetSource(file=str(path), interval=5.0)
    assert [t.name for t in source.poll(0.0) or []] == ["a"]
    assert source.poll(1.0) is None  # not due
    assert source.poll(6.0) is None  # due, unchanged
    path.write_text("dbname=a\ndbname=b\n")
    os.utime(path, (1, 1))
    assert [t.name for t in source.poll(12.0) or []] == ["a", "b"]


def test_a_missing_or_broken_targets_file_raises_and_keeps_the_targets(tmp_path: Path) -> None:
    path = tmp_path / "targets"
    path.write_text("dbname=a\n")
    source = TargetSource(file=str(path), interval=1.0)
    source.poll(0.0)
    path.unlink()
    with pytest.raises(InvalidSetting, match="cannot read the targets file"):
        source.poll(2.0)
    assert [t.name for t in source.current] == ["a"]


def test_either_a_file_or_a_server() -> None:
    with pytest.raises(InvalidSetting):
        TargetSource()
    with pytest.raises(InvalidSetting):
        TargetSource(file="x", discover="dbname=y")


def test_databases_without_the_table_are_looked_at_less_and_less_often() -> None:
    assert list(RECHECK_SECONDS) == sorted(RECHECK_SECONDS)
    assert RECHECK_SECONDS[0] <= 5.0  # found within seconds once migrated
