"""``outbox bench --horizon``'s per-window figures, from plain data (pure)."""

from __future__ import annotations

import pytest

from outbox.bench.horizon import (
    Sample,
    backlog,
    holder_named,
    parse_holders,
    sustained,
    window_figures,
)
from outbox.db.horizon import Holder, Horizon


def horizon(dead: int, *holders: Holder) -> Horizon:
    return Horizon(list(holders), 0, dead, 0, dead * 100, None)


def test_horizon_windows__latency_by_commit_time_and_deltas_per_window() -> None:
    committed = {"a": 0.1, "b": 0.9, "c": 1.5, "lost": 1.6}
    arrived = {"a": 0.102, "b": 0.904, "c": 1.55}
    samples = [
        Sample(0.0, 0, 0.0, 0.0, 0.0, horizon(0)),
        Sample(1.0, 100, 0.1, 0.2, 0.05, horizon(500)),
        Sample(2.0, 150, 0.2, 0.3, None, horizon(900)),
    ]
    first, second = window_figures(committed, arrived, 0.0, 1.0, samples)
    assert (first["committed"], first["delivered"], first["claims"]) == (2, 2, 100)
    assert (first["p50_ms"], first["p99_ms"]) == (4.0, 4.0)  # nearest rank: 2 ms, 4 ms
    assert (first["claim_mean_ms"], first["relay_cpu_ms_per_claim"]) == (1.0, 2.0)
    assert first["backend_cpu_ms_per_claim"] == 0.5 and first["dead_rows"] == 500
    # The lost row counts as committed, not delivered; no backend CPU: unknown.
    assert (second["committed"], second["delivered"], second["p50_ms"]) == (2, 1, 50.0)
    assert second["claim_mean_ms"] == 2.0 and second["backend_cpu_ms_per_claim"] is None


def test_horizon_names__the_oldest_holder_not_a_momentary_claim_or_a_logical_slot() -> None:
    claim = Holder("session", "pid 1", 10, 0.01, True, {"application_name": "outbox-relay"})
    report = Holder(
        "session", "pid 2", 5, 30.0, True, {"application_name": "pg_dump", "state": "active"}
    )
    slot = Holder("replication_slot", "cdc", 99, None, False, {})
    assert holder_named(horizon(0, claim)) == "nothing"
    assert holder_named(horizon(0, claim, slot)) == (
        "nothing holds the outbox (cdc: system catalogs only)"
    )
    assert holder_named(horizon(0, claim, report, slot)) == "session 'pg_dump' active"


def test_horizon_holders__parsed_or_refused() -> None:
    assert parse_holders("none, snapshot") == ("none", "snapshot")
    assert parse_holders("physical-slot") == ("physical-slot",)
    for bad in ("", "snapshot,vacuum"):
        with pytest.raises(ValueError, match="none, snapshot, untouched"):
            parse_holders(bad)


def test_horizon_backlog__committed_by_then_and_not_yet_delivered() -> None:
    committed = {"a": 1.0, "b": 2.0, "c": 3.0}
    arrived = {"a": 1.5, "b": 4.0}  # c never arrived
    assert [backlog(committed, arrived, at) for at in (0.5, 1.2, 1.6, 2.5, 3.5, 9.0)] == [
        0,
        1,
        0,
        1,
        2,
        1,
    ]


def test_horizon_ramp__a_rate_is_sustained_unless_the_writers_or_the_relay_fall_behind() -> None:
    def run(committed: int, growth: int) -> dict[str, float]:
        return {
            "rate": 1000.0,
            "last_window_seconds": 2.0,
            "committed_last_window": committed,
            "backlog_growth_last_window": growth,
        }

    # 2,000 rows due in the window; 5% of them is the slack either way.
    assert sustained(run(2000, 0)) is None
    assert sustained(run(1900, 100)) is None
    assert sustained(run(1899, 0)) == (
        "writers",
        "the writers committed 1,899 of 2,000 rows in the last window",
    )
    assert sustained(run(2000, 101)) == (
        "relays",
        "the backlog grew by 101 rows in the last window",
    )
