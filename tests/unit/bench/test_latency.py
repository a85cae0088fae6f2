"""The latency run's figures and the line that compares the relay with its baseline."""

from __future__ import annotations

from outbox.bench.harness import latency_figures
from outbox.bench.run import _baseline_lines


def test_latency_figures__only_what_arrived_counts_in_milliseconds() -> None:
    committed = {f"m{i}": float(i) for i in range(100)}
    arrived = {f"m{i}": i + (i + 1) / 1000 for i in range(99)}  # m99 never arrived
    figures = latency_figures(committed, 2000.4, arrived)
    assert figures["sent"] == 100 and figures["delivered"] == 99
    assert figures["committed_per_s"] == 2000
    assert figures["p50_ms"] <= figures["p95_ms"] <= figures["p99_ms"] <= figures["max_ms"]
    assert figures["max_ms"] == 99.0  # m98: 99 ms after its commit


def test_baseline_line__the_relay_as_a_multiple_of_the_loop_without_2pc() -> None:
    base = latency_figures({"a": 0.0}, 1.0, {"a": 0.004})
    relay = {**latency_figures({"a": 0.0}, 1.0, {"a": 0.010}), "baseline": base}
    [line] = _baseline_lines(relay)
    assert "p50 4.0 ms" in line and "2.50x its p50" in line and "2.50x its p99" in line
    assert _baseline_lines({"p50_ms": 1.0}) == []
