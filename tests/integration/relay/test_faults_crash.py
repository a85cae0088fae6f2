"""kill -9 of a relay at each step boundary, then clean-up by the resolver or a relay.

Each case crashes the relay deterministically with ``OUTBOX_CRASH_AT`` (25 rows,
batches of 10) and ends with ``check_delivery``; the outcome of every batch left
prepared and the duplicates asserted are exactly those of the crash table in
``outbox/relay/batches.py``.  Pipelined, batch 2 is claimed and prepared while batch 1
is in flight, so a crash can leave two batches: the second table lists what each
crash point leaves then (``point:2`` is its second occurrence, i.e. in batch 2 while
batch 1 is in flight).  With a crash point armed, batch 1's confirms are awaited and
its ledger record sent before batch 2 is claimed (``fault_injection.active``).
"""

from __future__ import annotations

import dataclasses
import json
import signal
from typing import Any

import pytest

from outbox.amqp import ledger
from outbox.config import Settings
from outbox.gid import parse
from tests.fixtures.faults import (
    RelayProcess,
    both_modes,
    check_delivery,
    drain,
    insert_rows,
    prepared_left,
    relay_sessions,
    wait_for,
)
from tests.fixtures.servers import Topology, run_cli, settings_env

BATCH = 10
ROWS = 25

# crash point -> (what the resolver does with each batch left, by batch, duplicates)
CRASH_TABLE: dict[str, tuple[list[str], int]] = {
    "after_claim": ([], 0),
    "after_prepare": (["rollback"], 0),
    "mid_publish": (["rollback"], BATCH // 2),
    "after_publish": (["rollback"], BATCH),
    "after_ledger": (["commit"], 0),
    "before_commit_prepared": (["commit"], 0),
}
# Pipelined: batch 2 is prepared and published while batch 1 is in flight.  With a
# crash point armed the relay waits for batch 1's confirms at the start of step 2
# (``fault_injection.active``), so batch 1's ledger record goes out before batch 2
# is claimed, as it does whenever the confirms are in by then (``batches.py``, "the
# schedule"; the unit tests' crash table covers confirms arriving later).
PIPELINED_CRASH_TABLE: dict[str, tuple[list[str], int]] = {
    "after_claim": ([], 0),
    "after_prepare": (["rollback"], 0),
    "mid_publish": (["rollback"], BATCH // 2),
    # batch 1 confirmed without evidence, before batch 2 is claimed
    "after_publish": (["rollback"], BATCH),
    # batch 1 has its evidence; batch 2 is published and confirmed without any
    "after_ledger": (["commit", "rollback"], BATCH),
    "before_commit_prepared": (["commit", "rollback"], BATCH),
    # batch 1's ledger record is confirmed: committed; batch 2's claim dies with
    # the session
    "after_claim:2": (["commit"], 0),
    "after_prepare:2": (["commit", "rollback"], 0),
    # batch 1 committed from its evidence; half of batch 2 is out
    "mid_publish:2": (["commit", "rollback"], BATCH // 2),
}
CASES = [(False, p) for p in CRASH_TABLE] + [(True, p) for p in PIPELINED_CRASH_TABLE]
CASE_IDS = [f"{'pipelined' if pipe else 'serial'}-{p}" for pipe, p in CASES]


def expected(settings: Settings, point: str) -> tuple[list[str], int]:
    return (PIPELINED_CRASH_TABLE if settings.pipeline else CRASH_TABLE)[point]


def by_seq(gids: list[Any]) -> list[Any]:
    def seq(gid: Any) -> int:
        parsed = parse(str(gid))
        assert parsed is not None
        return parsed.seq

    return sorted(gids, key=seq)


@pytest.fixture
def crash_settings(settings: Settings) -> Settings:
    return dataclasses.replace(settings, batch_size=BATCH)


def crash_relay(settings: Settings, point: str) -> None:
    relay = RelayProcess(settings, crash_at=point)
    try:
        assert relay.wait() == -signal.SIGKILL, relay.output()
    finally:
        relay.close()
    # The killed relay's sessions (and its advisory lock) go away within moments.
    wait_for(lambda: relay_sessions(settings.dsn) == 0, 10, "the dead relay's sessions to end")


def by_seq_batches(batches: list[dict[str, object]]) -> list[dict[str, object]]:
    order = {gid: i for i, gid in enumerate(by_seq([b["gid"] for b in batches]))}
    return sorted(batches, key=lambda b: order[b["gid"]])


def resolve_json(settings: Settings, *extra: str) -> list[dict[str, object]]:
    result = run_cli("resolve", "--json", *extra, env=settings_env(settings))
    assert result.returncode == 0, result.stderr
    batches: list[dict[str, object]] = json.loads(result.stdout)["batches"]
    return batches


@pytest.mark.parametrize(("pipeline", "point"), CASES, ids=CASE_IDS)
def test_crash__resolver_cleans_up_per_crash_table(
    point: str, crash_settings: Settings, topology: Topology
) -> None:
    actions, duplicates = expected(crash_settings, point)
    committed = insert_rows(crash_settings.dsn, topology.exchange, ROWS)
    crash_relay(crash_settings, point)
    in_doubt = by_seq(prepared_left(crash_settings.dsn))
    assert len(in_doubt) == len(actions)

    batches = by_seq_batches(resolve_json(crash_settings))

    assert [(b["gid"], b["owner"], b["action"]) for b in batches] == [
        (gid, "dead", action) for gid, action in zip(in_doubt, actions, strict=True)
    ]
    for b, action in zip(batches, actions, strict=True):
        assert b["outcome"] == ("committed" if action == "commit" else "rolled_back")
        assert b["evidence"] is (action == "commit")
    assert prepared_left(crash_settings.dsn) == []
    drain(crash_settings)
    report = check_delivery(crash_settings.dsn, topology, committed, max_duplicates=duplicates)
    assert report.duplicates == duplicates


@both_modes
@pytest.mark.parametrize("point", ["after_prepare", "after_publish", "after_ledger"])
def test_crash__next_relay_resolves_at_start_up(
    point: str, crash_settings: Settings, topology: Topology
) -> None:
    actions, duplicates = expected(crash_settings, point)
    committed = insert_rows(crash_settings.dsn, topology.exchange, ROWS)
    crash_relay(crash_settings, point)
    assert len(prepared_left(crash_settings.dsn)) == len(actions)

    drain(crash_settings)

    report = check_delivery(crash_settings.dsn, topology, committed, max_duplicates=duplicates)
    assert report.duplicates == duplicates


def test_crash__two_batches_in_flight_commits_the_evidenced_one_rolls_back_the_other(
    settings: Settings, topology: Topology
) -> None:
    pipelined = dataclasses.replace(settings, batch_size=BATCH, pipeline=True)
    committed = insert_rows(pipelined.dsn, topology.exchange, ROWS)
    # Batch 1's ledger record is confirmed; batch 2 was published after it and is
    # confirmed too, but has no ledger record yet.
    crash_relay(pipelined, "after_ledger")
    first, second = by_seq(prepared_left(pipelined.dsn))
    assert [parse(first).seq, parse(second).seq] == [1, 2]  # type: ignore[union-attr]
    recorded = ledger.finished_gids(pipelined.amqp_url, pipelined.ledger_queue, since=None)
    assert recorded & {first, second} == {first}

    outcomes = {b["gid"]: b["outcome"] for b in resolve_json(pipelined)}

    assert outcomes == {first: "committed", second: "rolled_back"}
    drain(pipelined)
    report = check_delivery(pipelined.dsn, topology, committed, max_duplicates=2 * BATCH)
    # Exactly batch 2 arrives twice: once before the crash, once after the rollback.
    assert report.duplicates == BATCH
    assert sorted(n for n in report.counts.values() if n > 1) == [2] * BATCH


def test_resolve__dry_run_shows_decision_and_evidence_and_changes_nothing(
    settings: Settings, topology: Topology
) -> None:
    crash_settings = dataclasses.replace(settings, batch_size=BATCH, pipeline=False)
    committed = insert_rows(crash_settings.dsn, topology.exchange, ROWS)
    crash_relay(crash_settings, "after_ledger")
    [gid] = prepared_left(crash_settings.dsn)

    [planned] = resolve_json(crash_settings, "--dry-run")
    text = run_cli("resolve", "--dry-run", env=settings_env(crash_settings))

    assert planned == {**planned, "gid": gid, "action": "commit", "evidence": True}
    assert planned["outcome"] == "planned"
    assert gid in text.stdout and "in ledger" in text.stdout and "action=commit" in text.stdout
    assert prepared_left(crash_settings.dsn) == [gid]
    [done] = resolve_json(crash_settings)
    assert done["outcome"] == "committed"
    drain(crash_settings)
    check_delivery(crash_settings.dsn, topology, committed, max_duplicates=0)


def test_resolver__python_m_resolver_runs_one_pass(settings: Settings, topology: Topology) -> None:
    crash_settings = dataclasses.replace(settings, batch_size=BATCH, pipeline=False)
    import subprocess
    import sys

    committed = insert_rows(crash_settings.dsn, topology.exchange, ROWS)
    crash_relay(crash_settings, "after_prepare")
    [gid] = prepared_left(crash_settings.dsn)

    result = subprocess.run(
        [sys.executable, "-m", "resolver", "--json"],
        env=settings_env(crash_settings),
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode == 0, result.stderr
    [batch] = json.loads(result.stdout)["batches"]
    assert (batch["gid"], batch["outcome"]) == (gid, "rolled_back")
    drain(crash_settings)
    check_delivery(crash_settings.dsn, topology, committed, max_duplicates=0)
