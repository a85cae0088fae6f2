"""``outbox status``'s judgement, apart from its queries (pure)."""

from __future__ import annotations

import dataclasses

from outbox.db.horizon import Holder, Horizon
from outbox.ops.status import Observation, judge, render, report

CALM = Observation(
    table="outbox",
    schema_version=3,
    backlog_rows=0,
    oldest_row_age_seconds=0.0,
    prepared_batches=[],
    foreign_prepared_transactions=[],
    relays=[{"relay_id": "r1", "alive": True}],
    dead_letters=0,
    dead_letter_ordering_keys=0,
    replication_warning=None,
)


def problems(seen: Observation) -> list[str]:
    return judge(seen, max_prepared_age=60, max_backlog_age=300)


def test_status__nothing_to_do_when_all_is_calm() -> None:
    assert problems(CALM) == []
    assert report(CALM, [])["warnings"] == []


def test_status__an_old_prepared_batch_names_the_resolver() -> None:
    seen = dataclasses.replace(
        CALM, prepared_batches=[{"gid": "obx:outbox:r1:1", "age_seconds": 61.0}]
    )
    (problem,) = problems(seen)
    assert "61s old" in problem and "outbox resolve --dry-run" in problem


def test_status__a_young_prepared_batch_is_normal() -> None:
    seen = dataclasses.replace(
        CALM, prepared_batches=[{"gid": "obx:outbox:r1:1", "age_seconds": 59.0}]
    )
    assert problems(seen) == []


def test_status__dead_letters_and_held_keys_say_what_to_run() -> None:
    seen = dataclasses.replace(CALM, dead_letters=3, dead_letter_ordering_keys=1)
    found = problems(seen)
    assert any("3 dead letters" in p and "dead-letters list" in p for p in found)
    assert any("--ordering-key KEY" in p for p in found)


def test_status__an_old_backlog_says_whether_any_relay_runs() -> None:
    behind = dataclasses.replace(CALM, oldest_row_age_seconds=301.0)
    nobody = dataclasses.replace(behind, relays=[{"relay_id": "r1", "alive": False}])
    assert "relays are behind" in problems(behind)[0]
    assert "no relay is running" in problems(nobody)[0]
    assert report(nobody, problems(nobody))["live_relays"] == 0


def test_status__scheduled_rows_show_the_next_due_and_an_overdue_one_needs_a_relay() -> None:
    waiting = dataclasses.replace(CALM, relays=[], scheduled_rows=12, next_due_seconds=3.25)
    assert problems(waiting) == []
    assert "scheduled          12 rows, next due in 3.2s" in render(report(waiting, []))
    overdue = dataclasses.replace(waiting, scheduled_overdue_seconds=400.0)
    nobody = dataclasses.replace(overdue, relays=[])
    (problem,) = problems(nobody)
    assert "due for 400s" in problem and "no relay is running" in problem
    assert "oldest due 400.0s ago" in render(report(nobody, [problem]))


def test_status__an_unsafe_replica_is_a_warning_not_a_problem() -> None:
    seen = dataclasses.replace(CALM, replication_warning="asynchronous standby")
    assert problems(seen) == []
    assert report(seen, [])["warnings"] == ["asynchronous standby"]


def held(*holders: Holder, dead_rows: int = 240_000) -> Observation:
    horizon = Horizon(list(holders), 0, dead_rows, 10, 75 * 2**20, None)
    return dataclasses.replace(CALM, horizon=horizon)


def session(age: float, pid: int = 4242) -> Holder:
    detail = {"pid": pid, "application_name": "pg_dump", "role": "backup"}
    return Holder("session", f"pid {pid}", 5000, age, True, {**detail, "state": "active"})


def test_status__an_old_snapshot_is_named_with_its_pid_and_what_to_do() -> None:
    (problem,) = judge(held(session(601)), max_prepared_age=60, max_backlog_age=300)
    assert "session pid 4242 (pg_dump, role backup, active)" in problem
    assert "601s, 5,000 transactions" in problem and "240,000 dead rows" in problem
    assert "pg_terminate_backend(4242)" in problem


def test_status__a_young_snapshot_is_normal() -> None:
    assert judge(held(session(599)), max_prepared_age=60, max_backlog_age=300) == []


def test_status__a_logical_slot_holds_only_the_catalogs_and_needs_no_attention() -> None:
    slot = Holder("replication_slot", "cdc", 9_000_000, None, False, {"slot_type": "logical"})
    assert judge(held(slot), max_prepared_age=60, max_backlog_age=300) == []


def test_status__a_slot_far_behind_says_drop_or_reconnect_it() -> None:
    slot = Holder("replication_slot", "standby1", 2_000_000, None, True, {"slot_type": "physical"})
    (problem,) = judge(held(slot), max_prepared_age=60, max_backlog_age=300)
    assert "replication slot 'standby1' (physical, inactive)" in problem
    assert "pg_drop_replication_slot('standby1')" in problem


def test_status__prepared_transactions_ours_and_others_say_who_finishes_them() -> None:
    ours = Holder("prepared_transaction", "obx:outbox:" + "a" * 32 + ":1", 10, 700.0, True, {})
    theirs = Holder("prepared_transaction", "billing-42", 10, 700.0, True, {})
    (mine,) = judge(held(ours), max_prepared_age=3600, max_backlog_age=300)
    (other,) = judge(held(theirs), max_prepared_age=3600, max_backlog_age=300)
    assert "outbox resolve --dry-run" in mine
    assert "not ours" in other and "outbox never touches it" in other


def test_status__prepared_transactions_disabled_is_said_with_the_setting() -> None:
    (problem,) = problems(dataclasses.replace(CALM, prepared_slots=0))
    assert "max_prepared_transactions = 0" in problem and "no relay can work here" in problem
    assert problems(dataclasses.replace(CALM, prepared_slots=64)) == []
