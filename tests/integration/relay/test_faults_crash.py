"""kill -9 of a relay at each step boundary, then clean-up by the resolver or a relay.

Each case crashes the relay with ``OUTBOX_CRASH_AT`` (25 rows, batches of 10) and
ends with ``check_delivery``.  The crash points only observe the production schedule
(``outbox/fault_injection.py``): nothing waits for a confirm production would not
wait for, so how much of an unconfirmed send reached the broker, and at depth 2
whether batch 1's confirms were in before batch 2's claim, are the broker's.  The
test learns them from the evidence: the batches left prepared, the ledger (the
resolver's ``evidence``), and what the queue holds after the crash; it asserts what
the crash table of ``outbox/relay/batches.py`` states whatever they were: nothing
lost, no prepared transaction left, a batch committed exactly when its record is in
the ledger, and the duplicates within the table's bound (≤ batch_size at depth 1,
≤ 2 x batch_size at depth 2), each one a row rolled back whose first copy was on
the queue at the crash.  ``point:2`` is the point's second occurrence, i.e. in
batch 2 while batch 1 is in flight.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from outbox import fault_injection
from outbox.amqp import ledger
from outbox.config import Settings
from outbox.gid import parse
from tests.fixtures.faults import (
    RelayProcess,
    arrived,
    both_modes,
    check_delivery,
    crash_relay,
    drain,
    ids_left,
    insert_rows,
    prepared_left,
)
from tests.fixtures.servers import Topology, run_cli, settings_env

BATCH = 10
ROWS = 25


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a crash at one point may leave, whatever the broker had reached by then."""

    # What the resolver may do with the batches left prepared, by batch.
    actions: frozenset[tuple[str, ...]]
    duplicates: range  # after resolving and draining


def outcome(*actions: tuple[str, ...], most: int = 0, least: int = 0) -> Outcome:
    return Outcome(frozenset(actions), range(least, most + 1))


NONE: tuple[str, ...] = ()
ROLLBACK = ("rollback",)
COMMIT = ("commit",)

CRASH_TABLE: dict[str, Outcome] = {
    "after_claim": outcome(NONE),
    "after_prepare": outcome(ROLLBACK),
    # sent, no confirm taken: none to all of the batch on the broker
    "mid_publish": outcome(ROLLBACK, most=BATCH),
    # every message confirmed, no record
    "after_publish": outcome(ROLLBACK, least=BATCH, most=BATCH),
    "after_ledger": outcome(COMMIT),
    "before_commit_prepared": outcome(COMMIT),
}
# Pipelined: batch 2 is claimed and prepared while batch 1 is in flight.  Batch 1's
# ledger record goes out before batch 2's claim if its confirms are in by then, else
# after batch 2's PREPARE (``batches.py``, "the schedule"); the crash may find either.
PIPELINED_CRASH_TABLE: dict[str, Outcome] = {
    "after_claim": outcome(NONE),
    "after_prepare": outcome(ROLLBACK),
    "mid_publish": outcome(ROLLBACK, most=BATCH),
    # batch 1 confirmed without a record; batch 2 not claimed yet, prepared, or
    # (batch 1's confirms still due at its PREPARE) sent beside batch 1: none to all
    # of it on the broker
    "after_publish": outcome(ROLLBACK, ROLLBACK * 2, least=BATCH, most=2 * BATCH),
    # batch 1 has its evidence; batch 2 is sent, not confirmed
    "after_ledger": outcome(COMMIT + ROLLBACK, most=BATCH),
    "before_commit_prepared": outcome(COMMIT + ROLLBACK, most=BATCH),
    # batch 1 published, its record sent (in the ledger or not yet) or not; batch
    # 2's claim dies with the session
    "after_claim:2": outcome(COMMIT, ROLLBACK, most=BATCH),
    "after_prepare:2": outcome(COMMIT + ROLLBACK, ROLLBACK * 2, most=BATCH),
    # …and batch 2 sent, not confirmed
    "mid_publish:2": outcome(COMMIT + ROLLBACK, ROLLBACK * 2, most=2 * BATCH),
}
CASES = [(False, p) for p in CRASH_TABLE] + [(True, p) for p in PIPELINED_CRASH_TABLE]
CASE_IDS = [f"{'pipelined' if pipe else 'serial'}-{p}" for pipe, p in CASES]
# The cases CI also runs against a multi-database relay (``-m fleet_faults``).
FLEET_CASES = {(False, "mid_publish"), (True, "after_ledger"), (True, "mid_publish:2")}
PARAMS = [
    pytest.param(*case, id=case_id, marks=[pytest.mark.fleet_faults] if case in FLEET_CASES else [])
    for case, case_id in zip(CASES, CASE_IDS, strict=True)
]


def expected(settings: Settings, point: str) -> Outcome:
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


def by_seq_batches(batches: list[dict[str, object]]) -> list[dict[str, object]]:
    order = {gid: i for i, gid in enumerate(by_seq([b["gid"] for b in batches]))}
    return sorted(batches, key=lambda b: order[b["gid"]])


def resolve_json(settings: Settings, *extra: str) -> list[dict[str, object]]:
    result = run_cli("resolve", "--json", *extra, env=settings_env(settings))
    assert result.returncode == 0, result.stderr
    batches: list[dict[str, object]] = json.loads(result.stdout)["batches"]
    return batches


@pytest.mark.parametrize(("pipeline", "point"), PARAMS)
def test_crash__resolver_cleans_up_per_crash_table(
    point: str, crash_settings: Settings, topology: Topology
) -> None:
    table = expected(crash_settings, point)
    dsn = crash_settings.dsn
    committed = insert_rows(dsn, topology.exchange, ROWS)
    crash_relay(crash_settings, point)
    in_doubt = by_seq(prepared_left(dsn))

    # Only this database's: pg_prepared_xacts lists the cluster's, and a fleet's
    # (OUTBOX_TEST_RELAY=fleet) other database has batches of its own there ("foreign").
    batches = by_seq_batches([b for b in resolve_json(crash_settings) if b["owner"] != "foreign"])

    actions = tuple(str(b["action"]) for b in batches)
    assert actions in table.actions, f"the crash left {actions}"
    assert [(b["gid"], b["owner"]) for b in batches] == [(gid, "dead") for gid in in_doubt]
    for b in batches:
        assert b["evidence"] is (b["action"] == "commit")
        assert b["outcome"] == ("committed" if b["action"] == "commit" else "rolled_back")
    recorded = ledger.finished_gids(
        crash_settings.amqp_url, crash_settings.ledger_queue, since=None
    )
    assert {b["gid"] for b in batches if b["action"] == "commit"} <= recorded
    assert prepared_left(dsn) == []
    # The evidence of what the dead relay had reached: the messages it got onto the
    # queue, and the rows that are to go out again (rolled back, or never claimed).
    before, again = arrived(topology), ids_left(dsn)
    assert set(committed) - again <= set(before), "a committed row is not on the queue"

    drain(crash_settings)

    report = check_delivery(
        dsn, topology, committed, max_duplicates=table.duplicates[-1], taken=before
    )
    print(
        f"{point}: left {actions}, {sum(before.values())} messages on the queue at the "
        f"crash, {report.duplicates} duplicates"
    )
    # Each duplicate is a row rolled back whose first copy was on the queue at the crash.
    assert report.duplicates == len(again & set(before))
    assert report.duplicates in table.duplicates


@pytest.mark.fleet_faults
@both_modes
@pytest.mark.parametrize("point", ["after_prepare", "after_publish", "after_ledger"])
def test_crash__next_relay_resolves_at_start_up(
    point: str, crash_settings: Settings, topology: Topology
) -> None:
    table = expected(crash_settings, point)
    committed = insert_rows(crash_settings.dsn, topology.exchange, ROWS)
    crash_relay(crash_settings, point)
    assert len(prepared_left(crash_settings.dsn)) in {len(a) for a in table.actions}

    drain(crash_settings)

    bound = table.duplicates[-1]
    report = check_delivery(crash_settings.dsn, topology, committed, max_duplicates=bound)
    assert report.duplicates in table.duplicates


def test_crash__a_relay_without_the_suites_switch_ignores_outbox_crash_at(
    crash_settings: Settings, topology: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A production process: OUTBOX_CRASH_AT inherited by mistake, no test suite."""
    committed = insert_rows(crash_settings.dsn, topology.exchange, ROWS)
    monkeypatch.delenv(fault_injection.SWITCH)
    relay = RelayProcess(crash_settings, crash_at="after_claim", drain=True)
    try:
        assert relay.wait() == 0, relay.output()
    finally:
        relay.close()
    check_delivery(crash_settings.dsn, topology, committed, max_duplicates=0)


def test_crash__two_batches_in_flight_commits_the_evidenced_one_rolls_back_the_other(
    settings: Settings, topology: Topology
) -> None:
    pipelined = dataclasses.replace(settings, batch_size=BATCH, pipeline=True)
    committed = insert_rows(pipelined.dsn, topology.exchange, ROWS)
    # Batch 1's ledger record is confirmed; batch 2 was sent after it, not confirmed
    # yet, and has no ledger record.
    crash_relay(pipelined, "after_ledger")
    first, second = by_seq(prepared_left(pipelined.dsn))
    assert [parse(first).seq, parse(second).seq] == [1, 2]  # type: ignore[union-attr]
    recorded = ledger.finished_gids(pipelined.amqp_url, pipelined.ledger_queue, since=None)
    assert recorded & {first, second} == {first}

    outcomes = {b["gid"]: b["outcome"] for b in resolve_json(pipelined)}

    assert outcomes == {first: "committed", second: "rolled_back"}
    before, again = arrived(topology), ids_left(pipelined.dsn)
    assert len(again) == ROWS - BATCH  # batch 2 and the rows never claimed
    drain(pipelined)
    report = check_delivery(pipelined.dsn, topology, committed, max_duplicates=BATCH, taken=before)
    # Only batch 2 arrives twice: what of it the broker had at the crash, then all of
    # it after the rollback.
    assert {m for m, n in report.counts.items() if n > 1} == again & set(before)
    assert set(report.counts.values()) <= {1, 2}


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
