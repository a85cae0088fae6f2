"""kill -9 of a relay at each step boundary, then clean-up by the resolver or a relay.

Each case crashes the first batch (10 rows of 25) deterministically with
``OUTBOX_CRASH_AT`` and ends with ``check_delivery``; the duplicates asserted are
exactly those of the crash table in ``outbox/relay.py``.
"""

from __future__ import annotations

import dataclasses
import json
import signal

import pytest

from outbox.config import Settings
from tests.fixtures.faults import (
    RelayProcess,
    check_delivery,
    insert_rows,
    prepared_left,
    relay_sessions,
    wait_for,
)
from tests.fixtures.servers import Topology, run_cli, settings_env

BATCH = 10
ROWS = 25

# crash point -> (what the resolver does with the batch, duplicates after clean-up)
CRASH_TABLE = {
    "after_claim": (None, 0),
    "after_prepare": ("rollback", 0),
    "mid_publish": ("rollback", BATCH // 2),
    "after_publish": ("rollback", BATCH),
    "after_ledger": ("commit", 0),
    "before_commit_prepared": ("commit", 0),
}


@pytest.fixture
def crash_settings(settings: Settings) -> Settings:
    # One batch in flight, so the exact per-step figures of the crash table apply;
    # pipelined, a crash also leaves the next batch (at most 2 x BATCH duplicates).
    return dataclasses.replace(settings, batch_size=BATCH, pipeline=False)


def crash_relay(settings: Settings, point: str) -> None:
    relay = RelayProcess(settings, crash_at=point)
    try:
        assert relay.wait() == -signal.SIGKILL, relay.output()
    finally:
        relay.close()
    # The killed relay's sessions (and its advisory lock) go away within moments.
    wait_for(lambda: relay_sessions(settings.dsn) == 0, 10, "the dead relay's sessions to end")


def drain(settings: Settings) -> None:
    relay = RelayProcess(settings, drain=True)
    try:
        assert relay.wait() == 0, relay.output()
    finally:
        relay.close()


def resolve_json(settings: Settings, *extra: str) -> list[dict[str, object]]:
    result = run_cli("resolve", "--json", *extra, env=settings_env(settings))
    assert result.returncode == 0, result.stderr
    batches: list[dict[str, object]] = json.loads(result.stdout)["batches"]
    return batches


@pytest.mark.parametrize("point", list(CRASH_TABLE))
def test_crash__resolver_cleans_up_per_crash_table(
    point: str, crash_settings: Settings, topology: Topology
) -> None:
    action, duplicates = CRASH_TABLE[point]
    committed = insert_rows(crash_settings.dsn, topology.exchange, ROWS)
    crash_relay(crash_settings, point)
    in_doubt = prepared_left(crash_settings.dsn)
    assert len(in_doubt) == (0 if action is None else 1)

    batches = resolve_json(crash_settings)

    assert [(b["gid"], b["owner"], b["action"]) for b in batches] == [
        (gid, "dead", action) for gid in in_doubt
    ]
    for b in batches:
        assert b["outcome"] == ("committed" if action == "commit" else "rolled_back")
        assert b["evidence"] is (action == "commit")
    assert prepared_left(crash_settings.dsn) == []
    drain(crash_settings)
    report = check_delivery(crash_settings.dsn, topology, committed, max_duplicates=duplicates)
    assert report.duplicates == duplicates


@pytest.mark.parametrize("point", ["after_prepare", "after_publish", "after_ledger"])
def test_crash__next_relay_resolves_at_start_up(
    point: str, crash_settings: Settings, topology: Topology
) -> None:
    _, duplicates = CRASH_TABLE[point]
    committed = insert_rows(crash_settings.dsn, topology.exchange, ROWS)
    crash_relay(crash_settings, point)
    assert len(prepared_left(crash_settings.dsn)) == 1

    drain(crash_settings)

    report = check_delivery(crash_settings.dsn, topology, committed, max_duplicates=duplicates)
    assert report.duplicates == duplicates


def test_resolve__dry_run_shows_decision_and_evidence_and_changes_nothing(
    crash_settings: Settings, topology: Topology
) -> None:
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


def test_resolver__python_m_resolver_runs_one_pass(
    crash_settings: Settings, topology: Topology
) -> None:
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
