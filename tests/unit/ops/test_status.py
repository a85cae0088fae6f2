"""``outbox status``'s judgement, apart from its queries (pure)."""

from __future__ import annotations

import dataclasses

from outbox.ops.status import Observation, judge, report

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


def test_status__an_unsafe_replica_is_a_warning_not_a_problem() -> None:
    seen = dataclasses.replace(CALM, replication_warning="asynchronous standby")
    assert problems(seen) == []
    assert report(seen, [])["warnings"] == ["asynchronous standby"]
